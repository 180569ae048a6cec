"""SD1.5: one CLIP-L tower (last hidden state), UNet on VAE /8 latents, epsilon or v-prediction (SD2.x-style)."""
from __future__ import annotations

from tasks.lazy import LazyClass
from tasks.models.bases.adapter import KohyaLayout
from tasks.models.bases.unet import UNetAdapter


class SD15Adapter(UNetAdapter):
    family = "sd15"
    kohya = KohyaLayout("networks.lora", "sd_v1", names="unet", text_encoder_prefixes=(("text_encoder", "lora_te"),))
    pipeline_cls = LazyClass("diffusers", "StableDiffusionPipeline")
    text_components = ("tokenizer", "text_encoder")
    text_encoder_lora_modules = ("text_encoder",)  # train.text_encoder_lr
    # A real SD1.5 repo ships a safety checker: it would black out samples and is no component of theirs.
    skip_parts = dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False)

    def _encode(self, pipe, texts):
        embeds, _ = pipe.encode_prompt(texts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds}
