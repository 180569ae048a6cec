"""What SD1.5 and SDXL share: a UNet2DConditionModel on VAE /8 latents, a DDPM noise schedule with an
epsilon or v-prediction target, and CLIP text towers. Training follows diffusers'
examples/text_to_image/train_text_to_image_lora(_sdxl).py; a family subclass says only how its pipeline
encodes text and what extra conditioning its UNet takes."""
from __future__ import annotations

import json
from abc import abstractmethod
from pathlib import Path

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import FamilyAdapter, load_lora_file
from tasks.models.bases.losses import ddpm_loss, offset_noise

torch = lazy("torch")
diffusers = lazy("diffusers")

# use_safetensors=True: never fall back to pickled .bin weights.
_SAFE = dict(use_safetensors=True)
VAE_SCALE = 8  # pixels per latent (4 VAE down blocks)


class UNetAdapter(FamilyAdapter):
    original_layout = "ldm"  # loraflow-lora merge --into-base --layout original
    denoiser_cls = LazyClass("diffusers", "UNet2DConditionModel")
    denoiser_subfolder = "unet"
    pipeline_cls: type  # the family's diffusers pipeline: loading, text encoding, LoRA file format, sampling
    # Cached text tensors the UNet and the pipeline take (each also as `negative_<name>` for CFG).
    embed_names: tuple[str, ...] = ("prompt_embeds",)
    # Pipeline parts never loaded (not in any node's component identity).
    skip_parts: dict = {}
    # train.text_encoder_lr: CLIP's attention projections, as diffusers' --train_text_encoder and sd-scripts
    text_encoder_lora_targets = ("q_proj", "k_proj", "v_proj", "out_proj")

    latent_components = ("vae",)
    denoiser_components = ("unet",)
    sample_components = ("unet", "vae", "scheduler")
    size_multiple = VAE_SCALE  # no patching

    # -- latents ---------------------------------------------------------------------------------
    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """The first level dominates (most tokens): every resnet/attention block counted at its width."""
        w, h = size
        channels = config["block_out_channels"]
        return (h // 8) * (w // 8), channels[0], len(channels) * config.get("layers_per_block", 2) * 2

    def _vae_config(self) -> dict:
        return json.loads((self.model_dir / "vae" / "config.json").read_text())

    def vae_dtype(self) -> torch.dtype:
        """The VAE's compute dtype: fp32 where the config says force_upcast and the model is fp16, as the
        pipelines decode (the SDXL VAE overflows in fp16: NaN latents, NaN losses); else model.dtype."""
        upcast = self.dtype == torch.float16 and self._vae_config().get("force_upcast", True)
        return torch.float32 if upcast else self.dtype

    def latent_settings(self) -> dict:
        c, out = self._vae_config(), {}
        if self.vae_dtype() != self.dtype:
            out["vae_dtype"] = str(self.vae_dtype()).removeprefix("torch.")
        if c.get("latents_mean") is not None and c.get("latents_std") is not None:
            out["latents_stats"] = True
        return out

    def load_vae(self):
        # On the device (CUDA when there is one); the caller stores what it returns on the CPU.
        return diffusers.AutoencoderKL.from_pretrained(self.model_dir, subfolder="vae", dtype=self.vae_dtype(), **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # The mode, not a sample: the cached latent is then a pure function of the image. No shift in SD/SDXL;
        # a VAE with latents_mean/std is normalised by them as diffusers' SDXL example does (its pipeline
        # undoes it before decoding). Stored in model.dtype.
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        c = vae.config
        if c.get("latents_mean") is not None and c.get("latents_std") is not None:
            mean = torch.tensor(c.latents_mean, dtype=z.dtype, device=z.device).view(1, -1, 1, 1)
            std = torch.tensor(c.latents_std, dtype=z.dtype, device=z.device).view(1, -1, 1, 1)
            return ((z - mean) * c.scaling_factor / std).to(self.dtype)
        return (z * c.scaling_factor).to(self.dtype)

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        return self.pipeline_cls.from_pretrained(self.model_dir, unet=None, vae=None, dtype=self.dtype,
                                                 **self.text_encoder_parts(), **self.skip_parts, **_SAFE).to(self.device)

    @abstractmethod
    def _encode(self, pipe, texts: list[str]) -> dict[str, torch.Tensor]:
        """The pipeline's own encode_prompt, batched: {name in embed_names: [B, ...]}."""

    def encode_text_live(self, pipe, texts):
        """encode_text with gradients, the tensors left on the device (train.text_encoder_lr: the LoRA'd
        encoders train through the captions they encode)."""
        out = dict(self._encode(pipe, texts))
        # encode_prompt pads to the tokenizer's 77 tokens. The tokenizer's own mask marks real tokens
        # (bos..eos), which `ids != pad` would not: CLIP-L pads with its eos token.
        out["attention_mask"] = pipe.tokenizer(texts, padding="max_length", max_length=pipe.tokenizer.model_max_length,
                                               truncation=True, return_tensors="pt").attention_mask.to(torch.int64)
        return [{k: v[i] for k, v in out.items()} for i in range(len(texts))]

    @no_grad
    def encode_text(self, pipe, texts):
        return [{k: v.cpu() for k, v in d.items()} for d in self.encode_text_live(pipe, texts)]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.UNet2DConditionModel, "unet")

    def default_lora_targets(self):
        # The attention projections, as diffusers' SD/SDXL LoRA examples.
        return ["to_k", "to_q", "to_v", "to_out.0"]

    def load_train_scheduler(self):
        # The noise schedule the model was trained with (diffusers maps the Euler/DDIM sampler config).
        return diffusers.DDPMScheduler.from_pretrained(self.model_dir, subfolder="scheduler")

    def added_cond_kwargs(self, text: dict[str, torch.Tensor], latents: torch.Tensor) -> dict | None:
        """Extra UNet conditioning (SDXL's pooled text and size ids); none for SD1.5."""
        return None

    def training_loss(self, unet, latents, text, train_cfg, scheduler, generators):
        # All randomness from one generator per item: a seed fixes the whole run, however it is split.
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g, dtype=latents.dtype) for g in generators])
        noise = noise.to(latents.device)
        timesteps = torch.cat([torch.randint(0, scheduler.config.num_train_timesteps, (1,), generator=g)
                               for g in generators]).to(latents.device)
        noise = offset_noise(noise, train_cfg, generators)  # after the timestep draws: they stay as without it
        noisy = scheduler.add_noise(latents, noise, timesteps)
        prediction_type = scheduler.config.prediction_type
        if prediction_type == "epsilon":
            target = noise
        elif prediction_type == "v_prediction":
            target = scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"unsupported prediction_type {prediction_type!r} in {self.model_dir}/scheduler")
        pred = unet(noisy, timesteps, encoder_hidden_states=text["prompt_embeds"].to(latents.dtype),
                    added_cond_kwargs=self.added_cond_kwargs(text, latents), return_dict=False)[0]
        return ddpm_loss(pred, target, train_cfg, scheduler, timesteps)

    def save_lora(self, lora_state_dict, out_dir, lora_config, text_encoders: dict | None = None):
        # Keys stay in PEFT layout (`unet.<module>.lora_A.weight`), which diffusers loads as is, rather than
        # the examples' convert_state_dict_to_diffusers (`lora.down`): that renames only to_q/k/v/out.0, so
        # other target_modules would give a mixed file, and tasks/publish.py reads PEFT keys back.
        # text_encoders (train.text_encoder_lr): {component: (peft state dict, peft config)}, written as
        # `text_encoder.*` / `text_encoder_2.*` with their own adapter metadata, as the examples do.
        extra = {}
        for component, (state_dict, config) in (text_encoders or {}).items():
            extra.update({f"{component}_lora_layers": state_dict, f"{component}_lora_adapter_metadata": config})
        self.pipeline_cls.save_lora_weights(out_dir, unet_lora_layers=lora_state_dict,
                                            unet_lora_adapter_metadata=lora_config, safe_serialization=True, **extra)
        return Path(out_dir) / "pytorch_lora_weights.safetensors"

    # -- sampling --------------------------------------------------------------------------------
    def load_sampler(self, lora_file, denoiser=None, text_encoders: bool = False):
        # Renders from cached embeddings; with text_encoders (train.text_encoder_lr) the encoders are loaded
        # too, and the LoRA file's text-encoder layers go into them: prompts are then encoded with them.
        no_text = {} if text_encoders else {name: None for name in self.text_components}
        pipe = self.pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, **no_text, **self.skip_parts,
                                                 **self.live(denoiser),
                                                 **_SAFE)
        if lora_file is not None:
            load_lora_file(pipe, self.denoiser_subfolder, lora_file)
        pipe.set_progress_bar_config(disable=True)
        return self.place(pipe, denoiser)

    def unconditional(self, pipe, negative, empty):
        """The CFG negative: the prompt's own, else the empty prompt (what the pipeline encodes for
        negative_prompt=None). None lets the pipeline choose."""
        return negative if negative is not None else empty

    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # Real CFG with `guidance`; true_cfg is Flux's and unused here.
        kwargs = {name: prompt[name][None].to(self.dtype) for name in self.embed_names}
        uncond = self.unconditional(pipe, negative, empty)
        if uncond is not None:
            kwargs.update({f"negative_{name}": uncond[name][None].to(self.dtype) for name in self.embed_names})
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    generator=generator, output_type="pil", **kwargs).images[0]
