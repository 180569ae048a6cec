"""FLUX.2 [dev]: text from Mistral Small 3.1 (Mistral3ForConditionalGeneration; hidden states 10, 20 and 30 of
the caption after FLUX.2's system message in Mistral's chat template, stacked), a guidance-distilled
transformer (the guidance scale is an input of the model, no CFG). Follows diffusers' Flux2Pipeline and its
LoRA example (examples/dreambooth/train_dreambooth_lora_flux2.py); what it shares with [klein] is in flux2.py."""
from __future__ import annotations

import logging

from tasks.lazy import LazyClass, lazy
from tasks.models.bases.adapter import KohyaLayout
from tasks.models.bases.flux2 import KOHYA_RULES, TEXT_PARTS, Flux2Adapter
from tasks.models.bases.real_size import RealSize

diffusers = lazy("diffusers")
transformers = lazy("transformers")

log = logging.getLogger("loraflow")


class Flux2DevAdapter(Flux2Adapter):
    family = "flux2_dev"
    kohya = KohyaLayout("networks.lora_flux2", "flux2_dev", rules=KOHYA_RULES)  # [klein]'s names: the same converter
    pipeline_cls = LazyClass("diffusers", "Flux2Pipeline")

    def load_text_encoders(self):
        # The checkpoint's tokenizer folder is a PixtralProcessor, which transformers builds only with
        # torchvision (not installed here); encode_prompt calls just its apply_chat_template, which the
        # tokenizer in that folder has, so the tokenizer is loaded alone.
        tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir, subfolder="tokenizer")
        return diffusers.Flux2Pipeline.from_pretrained(self.model_dir, dtype=self.dtype, tokenizer=tokenizer,
                                                       **self.text_encoder_parts(), **TEXT_PARTS).to(self.device)

    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu",
               controls=()):
        # `guidance` is the pipeline's guidance_scale, an input of the distilled model (its example: 4.0); Flux2Pipeline
        # has no negative prompt and no CFG, so a prompt's negative (kohya --n) is not used; `true_cfg` is unused.
        if negative is not None:
            log.warning("FLUX.2 [dev] samples without a negative prompt (Flux2Pipeline has no CFG); --n is ignored")
        return self.render(pipe, prompt, width, height, steps, guidance, seed, generator_device, controls)

    # -- full size (bench.memory: tasks/models/bases/real_size.py) --------------------------------
    # Flux2Transformer2DModel's and AutoencoderKLFlux2's defaults are black-forest-labs/FLUX.2-dev's (32.2 B)
    real_sizes = (RealSize("flux2_dev", "Flux2Transformer2DModel", vae=("AutoencoderKLFlux2", {}),
                           text=(("text_encoder", "mistral_small_3_1"),),
                           rows=("int8+ckpt+swap32", "nf4+ckpt", "nf4+ckpt+swap16", "nf4+ckpt+offload+swap8"),
                           card=(24, 64), train_goal_gib=24),)
