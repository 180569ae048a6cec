"""Qwen-Image: an MMDiT (double-stream blocks) on 2x2 patches of its own VAE (AutoencoderKLQwenImage, /8, 16
channels, a video VAE run on one frame, per-channel latents_mean/std), text from Qwen2.5-VL (the last
hidden states of the caption in Qwen-Image's system template, the template's first 34 tokens dropped),
flow matching with true CFG. Follows diffusers' QwenImagePipeline and its LoRA example
(examples/dreambooth/train_dreambooth_lora_qwen_image.py)."""
from __future__ import annotations

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import KohyaLayout
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize

torch = lazy("torch")
diffusers = lazy("diffusers")

_SAFE = dict(use_safetensors=True)
_TEXT_PARTS = dict(transformer=None, vae=None, **_SAFE)
_SAMPLE_PARTS = dict(text_encoder=None, tokenizer=None, **_SAFE)


class QwenImageAdapter(TransformerAdapter):
    swap_blocks = ("transformer_blocks",)  # train.blocks_to_swap
    max_text_tokens = 1024  # QwenImagePipeline refuses a max_sequence_length above 1024 (the Edit presets use it)
    family = "qwenimage"
    original_layout = "diffusers"  # loraflow-lora merge --into-base --layout original
    kohya = KohyaLayout("networks.lora_qwen_image", "qwen_image", names="named")  # musubi-tuner's layout
    pipeline_cls = LazyClass("diffusers", "QwenImagePipeline")
    denoiser_cls = LazyClass("diffusers", "QwenImageTransformer2DModel")
    denoiser_subfolder = "transformer"
    sample_parts = _SAMPLE_PARTS

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        return diffusers.AutoencoderKLQwenImage.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype, **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # One frame of the video VAE ([B, C, 1, H, W]); the mode, normalised per channel as the pipeline
        # un-normalises before decoding (latents * std + mean). Stored 4-D, like every family's latents.
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)[:, :, None]).latent_dist.mode()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        return ((z - mean) / std)[:, :, 0]

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        return diffusers.QwenImagePipeline.from_pretrained(self.model_dir, dtype=self.dtype, **self.text_encoder_parts(),
                                                           **_TEXT_PARTS).to(self.device)

    @no_grad
    def encode_text(self, pipe, texts):
        # The pipeline's own encode_prompt (so the bytes are its bytes). It returns each batch padded to its
        # longest caption, cut at max_sequence_length; the cache stores every caption padded to
        # max_sequence_length (zeros) with its mask, so captions stack into batches of any mix of lengths.
        embeds, mask = pipe.encode_prompt(texts, device=self.device, max_sequence_length=self.max_sequence_length)
        return self.padded(embeds, mask)

    def padded(self, embeds, mask) -> list[dict]:
        if mask is None:  # all tokens real: the pipeline drops the mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.int64, device=embeds.device)
        pad = self.max_sequence_length - embeds.shape[1]
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, pad)).cpu()
        mask = torch.nn.functional.pad(mask.to(torch.int64), (0, pad)).cpu()
        return [{"prompt_embeds": embeds[i], "attention_mask": mask[i]} for i in range(len(embeds))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.QwenImageTransformer2DModel, "transformer")

    # diffusers' Qwen-Image LoRA example's default (--lora_layers unset): the image-stream attention.
    LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        b, c, h, w = latents.shape
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        packed = diffusers.QwenImagePipeline._pack_latents(noisy, b, c, h, w)
        embeds = text["prompt_embeds"].to(latents.dtype)
        mask = text["attention_mask"].to(latents.device)
        pred = transformer(hidden_states=packed, timestep=timesteps.to(latents.dtype) / 1000,
                           encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                           img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)[0]
        vae_scale = self.size_multiple // 2
        pred = diffusers.QwenImagePipeline._unpack_latents(pred, h * vae_scale, w * vae_scale, vae_scale)[:, :, 0]
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    def embeds(self, d: dict, name: str) -> dict:
        """A cached text as the pipeline's `<name>_embeds(_mask)`, cut back to its own tokens (the real tokens
        lead: right padding), mask all ones (the pipeline then drops it), as from a string."""
        n = int(d["attention_mask"].sum())
        return {f"{name}_embeds": d["prompt_embeds"][None, :n].to(self.dtype),
                f"{name}_embeds_mask": torch.ones(1, n, dtype=torch.int64, device=d["prompt_embeds"].device)}

    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # True CFG at `true_cfg` (the pipeline's true_cfg_scale, on when > 1) against the prompt's negative,
        # else the cached empty prompt; `guidance` is unused (Qwen-Image has no distilled guidance). Each
        # caption is cut back to its own tokens: the pipeline's input from a string, mask dropped.
        kwargs = self.embeds(prompt, "prompt")
        if true_cfg > 1:
            kwargs.update(self.embeds(negative if negative is not None else empty, "negative_prompt"))
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(**kwargs, true_cfg_scale=true_cfg, width=width, height=height, num_inference_steps=steps,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil").images[0]

    # -- full size (bench.memory: tasks/models/bases/real_size.py) --------------------------------
    # QwenImageTransformer2DModel's and AutoencoderKLQwenImage's defaults are Qwen/Qwen-Image's configs (20.4 B)
    real_sizes = (RealSize("qwenimage", "QwenImageTransformer2DModel", vae=("AutoencoderKLQwenImage", {}),
                           text=(("text_encoder", "qwen2_5_vl_7b"),),
                           rows=("bf16+ckpt", "int8+ckpt", "int8+ckpt+swap20", "nf4+ckpt"), card=(16, 32),
                           train_goal_gib=24),)

    @staticmethod
    def bench_batch(config, size, frames, text_len):
        # 16-channel /8 latents, packed 2x2 by training_loss; Qwen2.5-VL's states and their mask
        w, h = size
        return torch.zeros(1, 16, h // 8, w // 8, dtype=torch.bfloat16), {
            "prompt_embeds": torch.zeros(1, text_len, config["joint_attention_dim"], dtype=torch.bfloat16),
            "attention_mask": torch.ones(1, text_len, dtype=torch.int64)}
