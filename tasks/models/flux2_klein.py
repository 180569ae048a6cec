"""FLUX.2 [klein]: text from Qwen3 (hidden states 9, 18 and 27 of the chat-templated caption, thinking off,
stacked), real CFG. Follows diffusers' Flux2KleinPipeline; what it shares with [dev] is in flux2.py."""
from __future__ import annotations

from tasks.lazy import LazyClass
from tasks.models.bases.adapter import KohyaLayout
from tasks.models.bases.flux2 import KOHYA_RULES, Flux2Adapter


class Flux2KleinAdapter(Flux2Adapter):
    family = "flux2_klein"
    kohya = KohyaLayout("networks.lora_flux2", "flux2_klein", rules=KOHYA_RULES)
    pipeline_cls = LazyClass("diffusers", "Flux2KleinPipeline")

    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu",
               controls=()):
        # Real CFG at `guidance` (the pipeline's guidance_scale, on above 1 for the undistilled base
        # models) against the prompt's negative, else the cached empty prompt (the pipeline's own negative
        # is ""); `true_cfg` is unused.
        kwargs = {}
        if guidance > 1 and not pipe.config.is_distilled:
            uncond = negative if negative is not None else empty
            kwargs["negative_prompt_embeds"] = uncond["prompt_embeds"][None].to(self.dtype)
        return self.render(pipe, prompt, width, height, steps, guidance, seed, generator_device, controls, **kwargs)
