"""Flow-matching pieces shared by the transformer families (Flux, SD3, Z-Image, Qwen-Image, FLUX.2): noise,
timestep draws and loss (diffusers' dreambooth LoRA examples), the LoRA file and the sampler."""
from __future__ import annotations

import math
from pathlib import Path

from tasks.config_schema import TrainConfig
from tasks.lazy import lazy
from tasks.models.bases.adapter import FamilyAdapter, load_lora_file
from tasks.models.bases.losses import flow_loss, offset_noise

torch = lazy("torch")
diffusers = lazy("diffusers")
training_utils = lazy("diffusers.training_utils")


def noise_latents(latents: torch.Tensor, train_cfg: TrainConfig, scheduler, generators: list[torch.Generator]):
    """(noisy, noise, timesteps, sigmas): timesteps drawn with the configured density. One generator per
    batch item (see tasks/train.py: item_generators), so an item's draws are the same however the batch
    is split across processes, and a seed fixes the whole run."""
    b = latents.shape[0]
    # CPU generators fill CPU tensors, which then move to the latents' device: same draws on any machine.
    noise = torch.stack([torch.randn(latents.shape[1:], generator=g, dtype=latents.dtype) for g in generators])
    noise = noise.to(latents.device)
    u = torch.cat([training_utils.compute_density_for_timestep_sampling(
        weighting_scheme=train_cfg.weighting_scheme, batch_size=1, logit_mean=train_cfg.logit_mean,
        logit_std=train_cfg.logit_std, mode_scale=train_cfg.mode_scale, generator=g) for g in generators])
    mode = train_cfg.timestep_sampling
    if mode == "sigma":  # a sigma of the scheduler's table (its own shift applied), as diffusers' examples
        indices = (u * scheduler.config.num_train_timesteps).long().clamp(max=len(scheduler.timesteps) - 1)
        sigmas = scheduler.sigmas[indices].to(latents.device, latents.dtype).view(b, *[1] * (latents.ndim - 1))
        timesteps = scheduler.timesteps[indices].to(latents.device)
    else:  # continuous, as sd-scripts' --timestep_sampling uniform / shift / flux_shift
        sigmas = shifted_sigmas(u, mode, train_cfg.discrete_flow_shift, latents.shape[-2:])
        timesteps = (sigmas * scheduler.config.num_train_timesteps).to(latents.device)
        sigmas = sigmas.to(latents.device, latents.dtype).view(b, *[1] * (latents.ndim - 1))  # video: [B,C,F,h,w]
    noise = offset_noise(noise, train_cfg, generators)  # after the sigma draws: they stay as without it
    return (1.0 - sigmas) * latents + sigmas * noise, noise, timesteps, sigmas


def weighted_loss(pred: torch.Tensor, target: torch.Tensor, sigmas: torch.Tensor, train_cfg: TrainConfig) -> torch.Tensor:
    """The weighting scheme's per-sigma weights times train.loss (l2 or huber), averaged."""
    return flow_loss(pred, target, training_utils.compute_loss_weighting_for_sd3(train_cfg.weighting_scheme, sigmas), train_cfg)


def shifted_sigmas(u: torch.Tensor, mode: str, shift: float, latent_hw) -> torch.Tensor:
    """u in [0, 1) -> sigma: as drawn (uniform), with the scheduler's static shift formula (shift), or with
    Flux's resolution-dependent mu (flux_shift: diffusers' calculate_shift on the packed sequence length,
    the time shift of FlowMatchEulerDiscreteScheduler)."""
    if mode == "uniform":
        return u
    if mode == "shift":
        return shift * u / (1 + (shift - 1) * u)
    if mode == "flux_shift":
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        mu = calculate_shift((latent_hw[0] // 2) * (latent_hw[1] // 2))
        return math.exp(mu) / (math.exp(mu) + (1 / u - 1))
    raise ValueError(f"train.timestep_sampling={mode!r}: choose sigma, uniform, shift or flux_shift")


class TransformerAdapter(FamilyAdapter):
    """What every flow-matching transformer family does the same way: the diffusers LoRA file of its transformer,
    and a sampler built from its pipeline without the text encoders (it samples from cached embeddings)."""
    flow_matching = True
    sample_parts: dict  # from_pretrained arguments that leave the text encoders and tokenizers out
    # Every transformer family's layout; a family with several text encoders (Flux, SD3) names its own.
    single_file_holds = "denoiser"  # e.g. flux1-dev.safetensors, z_image_turbo_bf16.safetensors: the transformer only
    latent_components = ("vae",)
    text_components = ("tokenizer", "text_encoder")
    denoiser_components = ("transformer",)
    sample_components = ("transformer", "vae", "scheduler")
    size_multiple = 16  # VAE /8, then 2x2 patches
    # peft target_modules: one regex matched against whole module paths, or names matched by suffix
    LORA_TARGETS: str | tuple[str, ...]

    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """Joint attention over the image's patches and the caption's tokens in every block (Flux, SD3,
        Qwen-Image, FLUX.2): patches of patch_size latents, 2x2 packed where the model has single blocks."""
        w, h = size
        width = config["num_attention_heads"] * config["attention_head_dim"]
        patch = config.get("patch_size", 1) * (2 if "num_single_layers" in config else 1)
        tokens = (h // (8 * patch)) * (w // (8 * patch)) + text_tokens
        return tokens, width, config.get("num_layers", 0) + config.get("num_single_layers", 0)

    def default_lora_targets(self):
        return self.LORA_TARGETS if isinstance(self.LORA_TARGETS, str) else list(self.LORA_TARGETS)

    def load_train_scheduler(self):
        return diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(self.model_dir, subfolder="scheduler")

    def save_lora(self, lora_state_dict, out_dir, lora_config):
        self.pipeline_cls.save_lora_weights(out_dir, transformer_lora_layers=lora_state_dict,
                                            transformer_lora_adapter_metadata=lora_config, safe_serialization=True)
        return Path(out_dir) / "pytorch_lora_weights.safetensors"

    def load_sampler(self, lora_file, denoiser=None):
        pipe = self.pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, **self.live(denoiser),
                                                 **self.sample_parts)
        if lora_file is not None:
            load_lora_file(pipe, self.denoiser_subfolder, lora_file)
        pipe.set_progress_bar_config(disable=True)
        return self.place(pipe, denoiser)
