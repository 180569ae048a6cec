"""Wan 2.1 / 2.2 (text-to-video): WanTransformer3DModel on 1x2x2 patches of the causal video VAE's latents
(AutoencoderKLWan: /8 in space, /4 in time, 1 + 4k frames, 16 channels normalised per channel), text from UMT5
(last hidden states, zero-padded to max_sequence_length, as the pipeline pads them), flow matching with real CFG.
Follows diffusers' WanPipeline (pipelines/wan/pipeline_wan.py: `_get_t5_prompt_embeds`, the latents' un-normalising
before `vae.decode`, the transformer called with `timestep` = t in [0, 1000]) and musubi-tuner's Wan training
(velocity target noise - latents, timesteps shifted by the sampler's flow_shift).

A still image trains as a one-frame video (the VAE's first frame is encoded alone), as the video trainers do.
Wan 2.2 (two experts split at the pipeline's boundary_ratio) is tasks/models/wan22.py."""
from __future__ import annotations

from tasks.data.clips import Video
from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import Clips, KohyaLayout
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize

torch = lazy("torch")
diffusers = lazy("diffusers")
np, Image = lazy("numpy"), lazy("PIL.Image")  # decoding a video only; a no-op run imports this module

_SAFE = dict(use_safetensors=True)
_SAMPLE_PARTS = dict(text_encoder=None, tokenizer=None, **_SAFE)


WAN_BLOCK = r"blocks\.(\d+)\."
# The kohya file's names: Wan's original modules (musubi-tuner's networks.lora_wan; diffusers' WanPipeline converts
# them, expecting all ten Linears of every block; ComfyUI maps them by its generic rule)
KOHYA_RULES = (
    (WAN_BLOCK + r"attn1\.to_q", "blocks_{}_self_attn_q", 1), (WAN_BLOCK + r"attn1\.to_k", "blocks_{}_self_attn_k", 1),
    (WAN_BLOCK + r"attn1\.to_v", "blocks_{}_self_attn_v", 1), (WAN_BLOCK + r"attn1\.to_out\.0", "blocks_{}_self_attn_o", 1),
    (WAN_BLOCK + r"attn2\.to_q", "blocks_{}_cross_attn_q", 1), (WAN_BLOCK + r"attn2\.to_k", "blocks_{}_cross_attn_k", 1),
    (WAN_BLOCK + r"attn2\.to_v", "blocks_{}_cross_attn_v", 1), (WAN_BLOCK + r"attn2\.to_out\.0", "blocks_{}_cross_attn_o", 1),
    (WAN_BLOCK + r"ffn\.net\.0\.proj", "blocks_{}_ffn_0", 1),
    (WAN_BLOCK + r"ffn\.net\.2", "blocks_{}_ffn_2", 1),
)


class WanAdapter(TransformerAdapter):
    family = "wan"
    kohya = KohyaLayout("networks.lora_wan", "wan2.1", rules=KOHYA_RULES, lycoris_names="comfyui")
    # Wan's blocks save more per token (fp32 norms, cross-attention, a 2.7x FFN): measured on Wan 2.1 14B at 480x832,
    # 33 and 81 frames (bench.memory --families: 1228.3/1222.7 per 40 blocks without checkpointing, 72.9/72.7 with)
    activation_factors = (30.7, 1.03, 31.6)
    # the caption's T5 states are every block's cross-attention input: offloaded with each block
    activation_extras = {"text_offloaded": 1.0}
    clips = Clips(frame_step=4)  # the VAE's temporal factor: clips train at 1 + 4k frames
    latent_version = "2"  # a latent is stored with the frame rate it was taken at ("fps")
    swap_blocks = ("blocks",)  # train.blocks_to_swap
    pipeline_cls = LazyClass("diffusers", "WanPipeline")
    denoiser_cls = LazyClass("diffusers", "WanTransformer3DModel")
    denoiser_subfolder = "transformer"
    sample_parts = _SAMPLE_PARTS
    # Wan's LoRA trainers target every linear of the attention blocks (musubi-tuner's networks/lora_wan.py:
    # WanAttentionBlock); peft names in diffusers' model: self- and cross-attention, the feed-forward.
    LORA_TARGETS = r".*blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|.*blocks\.\d+\.ffn\.net\.(0\.proj|2)"

    # -- latents ---------------------------------------------------------------------------------
    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        """1x2x2 patches of (1 + (F - 1) / 4) latent frames; the caption is cross-attention's keys, not in the
        sequence."""
        w, h = size
        pt, ph, pw = config["patch_size"]
        latent_frames = 1 + (frames - 1) // 4
        tokens = (latent_frames // pt) * (h // (8 * ph)) * (w // (8 * pw))
        return tokens, config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]

    def load_vae(self):
        return diffusers.AutoencoderKLWan.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype, **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # pixels [B, 3, F, H, W] (an image: [B, 3, H, W], one frame) -> the mode, normalised per channel as the
        # pipeline un-normalises before decoding (latents * std + mean): [B, 16, 1 + (F - 1) / 4, H / 8, W / 8]
        if pixels.ndim == 4:
            pixels = pixels[:, :, None]
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        return (z - mean) / std

    # -- text ------------------------------------------------------------------------------------
    # WanPipeline's encode_prompt for every Wan model, image-to-video too: the same T5 states, without loading
    # an image-to-video pipeline's image encoder
    text_pipeline_cls = LazyClass("diffusers", "WanPipeline")

    def load_text_encoders(self):
        return self.text_pipeline_cls.from_pretrained(self.model_dir, dtype=self.dtype, transformer=None, vae=None,
                                                      **self.text_encoder_parts(),
                                                      **({"transformer_2": None} if self._has_expert_2() else {}),
                                                      **_SAFE).to(self.device)

    def _has_expert_2(self) -> bool:
        return (self.model_dir / "transformer_2").is_dir()

    def sample_denoisers(self):
        # Wan 2.2 A14B samples with both experts, whichever one a run trains
        return tuple(f for f in ("transformer", "transformer_2") if (self.model_dir / f).is_dir())

    @no_grad
    def encode_text(self, pipe, texts):
        # The pipeline's own T5 states: each caption's tokens, then zeros up to max_sequence_length (the
        # transformer reads the zeros; there is no mask), so every caption is stored at that length.
        embeds, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device=self.device,
                                       max_sequence_length=self.max_sequence_length)
        return [{"prompt_embeds": e} for e in embeds.cpu()]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(self.denoiser_cls, self.denoiser_subfolder)  # Wan 2.2: the expert trained

    def load_train_scheduler(self):
        # Wan ships a UniPC sampler; training draws from the flow-matching table with the sampler's flow_shift
        # (musubi-tuner's --discrete_flow_shift, 3.0 for Wan 2.1 at 480p), t = sigma x 1000.
        config = diffusers.UniPCMultistepScheduler.load_config(self.model_dir, subfolder="scheduler")
        return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=config["num_train_timesteps"],
                                                         shift=config.get("flow_shift") or 1.0)

    def draw(self, latents, train_cfg, scheduler, generators):
        """(noisy, noise, timesteps, sigmas): the flow-matching draws (Wan 2.2's expert keeps to its side)."""
        return noise_latents(latents, train_cfg, scheduler, generators)

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        if latents.ndim == 4:  # [B, C, h, w]: never stored by this family, but a one-frame video all the same
            latents = latents[:, :, None]
        noisy, noise, timesteps, sigmas = self.draw(latents, train_cfg, scheduler, generators)
        pred = transformer(hidden_states=noisy, timestep=timesteps.to(latents.dtype),
                           encoder_hidden_states=text["prompt_embeds"].to(latents.dtype), return_dict=False)[0]
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed,
               generator_device="cpu", frames=1, fps=16.0, controls=()):
        # Real CFG at `guidance` against the prompt's negative, else the cached empty prompt (the pipeline
        # cannot encode "" without its text encoder); `true_cfg` is unused. Frames 1 + 4k (the VAE's rule).
        # Image-to-video (tasks/models/wan_i2v.py): `controls` = the first frame, fitted to (width, height).
        uncond = negative if negative is not None else empty
        generator = self.make_generator(pipe, seed, generator_device)
        out = pipe(prompt_embeds=prompt["prompt_embeds"][None].to(self.dtype),
                   negative_prompt_embeds=uncond["prompt_embeds"][None].to(self.dtype),
                   **({"image": controls[0]} if controls else {}),
                   guidance_scale=guidance, width=width, height=height, num_frames=frames,
                   num_inference_steps=steps, max_sequence_length=self.max_sequence_length, generator=generator,
                   output_type="np").frames[0]
        return Video([Image.fromarray(f) for f in (np.clip(out, 0, 1) * 255).round().astype(np.uint8)], fps)

    # -- full size (bench.memory: tasks/models/bases/real_size.py) --------------------------------
    # WanTransformer3DModel's defaults are Wan-AI/Wan2.1-T2V-14B's config (5120 wide, 40 blocks; one Wan 2.2 A14B
    # expert has its shapes). At 480x832, 33 frames (9 latent frames, 14,040 tokens) fit a 24 GB card; the model
    # card's 81 (21, 32,760) do not.
    real_sizes = tuple(RealSize(name, "WanTransformer3DModel", size=(832, 480), frames=frames, vae=("AutoencoderKLWan", {}),
                                text=(("text_encoder", "umt5_xxl"),), **kw) for name, frames, kw in (
        ("wan14b", 33, dict(rows=("int8+ckpt", "nf4+ckpt", "int8+ckpt+swap20"), cards=(1,), train_goal_gib=24)),
        ("wan14b_81f", 81, dict(rows=("nf4+ckpt", "nf4+ckpt+swap30", "nf4+ckpt+offload", "int8+ckpt+offload",
                                      "nf4+ckpt+offload+swap11"), card=(24, 64)))))

    @staticmethod
    def bench_batch(config, size, frames, text_len):
        # 16-channel latents of the video VAE (/4 in time, /8 in space); UMT5's states
        (w, h), z = size, lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
        return z(1, 16, 1 + (frames - 1) // 4, h // 8, w // 8), {"prompt_embeds": z(1, text_len, config["text_dim"])}
