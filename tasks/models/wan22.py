"""Wan 2.2 (A14B text-to-video): Wan 2.1's architecture as two experts, `transformer` for the high-noise steps
(t >= boundary_ratio x 1000) and `transformer_2` for the low-noise rest, as diffusers' WanPipeline switches
between them while sampling (pipelines/wan/pipeline_wan.py: `boundary_timestep`).

`model.expert=high|low` picks the expert a run trains: its LoRA sees only timesteps on its side of the boundary
(musubi-tuner's `--timestep_boundary` split; each draw is repeated from the item's own generator until it lands
there, so a seed fixes the run), and it is that expert's LoRA file, as Wan 2.2 LoRAs are published: one per
expert, loaded with `load_lora_weights(file)` (high) or `load_lora_weights(file, load_into_transformer_2=True)`
(low). `model.expert=both` trains one LoRA on both experts in one run, each timestep through its expert
(tasks/models/wan22_experts.py), as musubi-tuner's `--dit_high_noise` does; its file loads into both. Or two runs
that share every cache: `loraflow -m model=tiny_wan22 model.expert=high,low`. Samples use both experts, the
trained one(s) with the LoRA."""
from __future__ import annotations

import functools
import json

from tasks.config import ConfigError
from tasks.lazy import lazy
from tasks.models.bases.adapter import KohyaLayout, load_lora_file
from tasks.models.wan import WanAdapter, noise_latents

torch = lazy("torch")
diffusers = lazy("diffusers")

EXPERTS = {"high": "transformer", "low": "transformer_2", "both": "transformer"}  # both: the file's layout is one expert's
MAX_DRAWS = 10_000


class Wan22Adapter(WanAdapter):
    family = "wan22"
    kohya = KohyaLayout("networks.lora_wan", "wan2.2", rules=WanAdapter.kohya.rules,  # one file per expert
                        lycoris_names="comfyui")
    # both experts' weights in the keys: which one trains is model.expert (in the LoRA's key)
    denoiser_components = ("transformer", "transformer_2")
    sample_components = ("transformer", "transformer_2", "vae", "scheduler")
    expert = "low"
    denoiser_subfolder = EXPERTS[expert]
    lora_file_component = "transformer"  # every expert's file (save_lora_weights' transformer_lora_layers)
    experts = {"high": EXPERTS["high"], "low": EXPERTS["low"]}

    train_version = "2"  # 2: the low expert trains on transformer_2's weights (1 loaded transformer's)

    def configure(self, model_cfg):
        expert = model_cfg.expert or self.expert
        if expert not in EXPERTS:
            raise ConfigError(f"model.expert={expert!r}: Wan 2.2 trains its high-noise expert, its low-noise "
                              "expert or one LoRA on both: model.expert=high, low or both")
        self.expert, self.denoiser_subfolder = expert, EXPERTS[expert]
        self.denoisers = 2 if expert == "both" else 1  # both experts resident (the preflight counts them)

    def load_denoiser(self):
        if self.expert != "both":
            return super().load_denoiser()
        from tasks.models.wan22_experts import TwoExperts  # torch and diffusers at import: training only

        high, low = (self.pretrained_denoiser(self.denoiser_cls, f)
                     for f in (EXPERTS["high"], EXPERTS["low"]))
        return TwoExperts(high, low, self.boundary)

    def lora_holder(self, denoiser):
        return denoiser.high if self.expert == "both" else denoiser  # the low expert holds the same Parameters

    def live(self, denoiser):
        if denoiser is None or self.expert != "both":
            return super().live(denoiser)
        return {EXPERTS["high"]: denoiser.high, EXPERTS["low"]: denoiser.low}

    @functools.cached_property
    def boundary(self) -> float:
        """The timestep where sampling switches experts: boundary_ratio x num_train_timesteps (the pipeline's)."""
        ratio = json.loads((self.model_dir / "model_index.json").read_text()).get("boundary_ratio")
        if ratio is None:
            raise ConfigError(f"model.family=wan22: {self.model_dir} has no boundary_ratio in model_index.json (a "
                              "Wan 2.1 model? use model.family=wan)")
        config = diffusers.UniPCMultistepScheduler.load_config(self.model_dir, subfolder="scheduler")
        return ratio * config["num_train_timesteps"]

    def draw(self, latents, train_cfg, scheduler, generators):
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        for i, g in enumerate(generators):
            for _ in range(MAX_DRAWS):
                if self._mine(timesteps[i]):
                    break
                one = noise_latents(latents[i:i + 1], train_cfg, scheduler, [g])
                for out, new in zip((noisy, noise, timesteps, sigmas), one):
                    out[i] = new[0]
            else:
                raise ConfigError(f"model.expert={self.expert}: no timestep on its side of the boundary "
                                  f"({self.boundary:g}) in {MAX_DRAWS} draws; check train.timestep_sampling")
        return noisy, noise, timesteps, sigmas

    def _mine(self, t) -> bool:
        if self.expert == "both":
            return True
        return bool(t >= self.boundary) if self.expert == "high" else bool(t < self.boundary)

    def load_sampler(self, lora_file, denoiser=None):
        pipe = self.pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, **self.live(denoiser), **self.sample_parts)
        if lora_file is not None:
            from tasks.models.lora_variants import lycoris

            if self.expert in ("high", "both"):
                load_lora_file(pipe, EXPERTS["high"], lora_file)
            if self.expert in ("low", "both"):
                if lycoris.file_network(lora_file) or lycoris.is_lycoris_file(lora_file):
                    load_lora_file(pipe, EXPERTS["low"], lora_file)
                else:
                    pipe.load_lora_weights(str(lora_file), load_into_transformer_2=True)
        pipe.set_progress_bar_config(disable=True)
        return self.place(pipe, denoiser)
