"""Chroma (lodestones): FLUX.1-schnell's double and single blocks whose modulation comes from a small approximator
(`distilled_guidance_layer`) instead of per-block Linears, on FLUX.1's VAE latents (/8, 16 channels, 2x2 packed),
text from T5 v1.1 XXL alone (no CLIP, no pooled vector, no guidance embedding), flow matching with real CFG.

What follows which reference (diffusers 0.42.1, pipelines/chroma/pipeline_chroma.py):
- Latents: FLUX.1's (FluxAdapter: the mode, `(z - shift_factor) * scaling_factor`, the inverse of what `__call__`
  does before vae.decode); packed 2x2 with ChromaPipeline._pack_latents, image ids from _prepare_latent_image_ids.
- Text: `_get_t5_prompt_embeds` (what encode_prompt returns): T5 run WITH the tokenizer's attention mask (unlike
  FLUX.1), the hidden states in the encoder's dtype, and the pipeline's `attention_mask` (every real token and the
  first padding token, in that dtype), both cached as the pipeline gives them.
- Training: timestep = sigma (the pipeline's `t / 1000`), target noise - latents (FlowMatchEulerDiscreteScheduler's
  velocity), text ids zeros, and no attention mask: ChromaPipeline.__call__ builds one with _prepare_attention_mask,
  which in 0.42.1 returns None (no return statement; the img2img pipeline's returns it), so the text-to-image
  pipeline's transformer sees every padding token. Training feeds what the sampler feeds; ai-toolkit's Chroma
  trainer masks (txt_mask), a difference noted here, not copied.
- LoRA targets, kohya and ComfyUI names: FLUX.1's (FluxAdapter). ComfyUI's Chroma model (comfy/ldm/chroma/model.py)
  has Flux's block names (double_blocks.N.img_attn.qkv, single_blocks.N.linear1, ...) and no modulation Linears,
  so the kohya file in BFL names is the ComfyUI file (tests/test_chroma.py cites the lines). diffusers' kohya
  converter reads Flux files with FLUX.1's widths hard-coded: the learning check merges the kohya file as ComfyUI.
- Sampling: the pipeline from cached text (no text encoder loaded), CFG at `guidance` (> 1) against the prompt's
  negative, else the cached empty prompt (what the pipeline encodes for no negative).

Untested with the real weights here."""
from __future__ import annotations

import logging

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import KohyaLayout, on_pipeline_device
from tasks.models.bases.flow_matching import noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize
from tasks.models.flux import FLUX1_VAE, KOHYA_RULES, FluxAdapter

torch = lazy("torch")
diffusers = lazy("diffusers")
transformers = lazy("transformers")

log = logging.getLogger("loraflow")
_SAFE = dict(use_safetensors=True)
_WARNED: set[str] = set()


class _TextEncoders:
    def __init__(self, tokenizer, text_encoder):
        self.tokenizer, self.text_encoder = tokenizer, text_encoder


class ChromaAdapter(FluxAdapter):
    family = "chroma"
    # BFL's names as FLUX.1's (sd-scripts' networks.lora_flux trains Chroma too); its own base version, as
    # ai-toolkit's get_base_model_version writes ("chroma"). The modulation rules never match: no such Linears
    kohya = KohyaLayout("networks.lora_flux", "chroma", rules=KOHYA_RULES, drop=r"proj_out")
    # Chroma1-HD.safetensors is BFL-named but holds the approximator, which the "flux" writer does not map
    original_layout = None
    pipeline_cls = LazyClass("diffusers", "ChromaPipeline")
    denoiser_cls = LazyClass("diffusers", "ChromaTransformer2DModel")
    text_components = ("tokenizer", "text_encoder")
    sample_parts = dict(text_encoder=None, tokenizer=None, **_SAFE)
    train_version = None
    # LORA_TARGETS, swap_blocks, load_vae, encode_latents, reference_kohya ("merge"): FLUX.1's

    # Chroma1-HD (diffusers layout at lodestones/Chroma1-HD): the transformer at ChromaTransformer2DModel's defaults
    # (19 double, 38 single blocks, 3072 wide, approximator 5120 x 5), T5 v1.1 XXL, FLUX.1's VAE. Rows: the card
    # table's picks at 1024 px, 512 tokens (bench.memory --families, 2026-11-29): bf16+ckpt 19.7 GiB (24 GB cards),
    # fp8+ckpt 11.4 GiB (16 GB), nf4+ckpt 7.4 GiB (12 GB); nf4+ckpt+offload+swap16 measured 5.1 GiB, not needed.
    real_sizes = (RealSize(
        name="chroma1_hd", denoiser="ChromaTransformer2DModel",
        text=(("text_encoder", "t5_xxl"),),
        vae=("AutoencoderKL", FLUX1_VAE),
        rows=("bf16+ckpt", "fp8+ckpt", "nf4+ckpt"), card=(12, 32)),)

    @staticmethod
    def bench_batch(config: dict, size: tuple[int, int], frames: int, text_len: int):
        w, h = size
        latents = torch.zeros(1, config["in_channels"] // 4, h // 8, w // 8, dtype=torch.bfloat16)
        text = {"prompt_embeds": torch.zeros(1, text_len, config["joint_attention_dim"], dtype=torch.bfloat16),
                "attention_mask": torch.ones(1, text_len, dtype=torch.bfloat16)}
        return latents, text

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        return _TextEncoders(
            tokenizer=transformers.T5TokenizerFast.from_pretrained(self.model_dir, subfolder="tokenizer"),
            text_encoder=self.pretrained_text_encoder("text_encoder", transformers.T5EncoderModel))

    @no_grad
    def encode_text(self, enc, texts):
        # ChromaPipeline._get_t5_prompt_embeds (a test holds the bytes equal to encode_prompt's)
        inputs = enc.tokenizer(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                               return_length=False, return_overflowing_tokens=False, return_tensors="pt")
        mask = inputs.attention_mask.to(self.device)
        embeds = enc.text_encoder(inputs.input_ids.to(self.device), output_hidden_states=False,
                                  attention_mask=mask)[0]
        dtype = enc.text_encoder.dtype
        embeds = embeds.to(dtype=dtype)
        # every real token and the first padding one, as the pipeline keeps them
        keep = (torch.arange(mask.shape[1], device=mask.device)[None] <= mask.sum(dim=1)[:, None]).to(dtype)
        for text, m in zip(texts, inputs.attention_mask):
            if m.all() and text not in _WARNED:  # a full window: maybe cut
                _WARNED.add(text)
                log.warning("text may be truncated at model.max_sequence_length=%d T5 tokens: %.80r",
                            self.max_sequence_length, text)
        embeds, keep = embeds.cpu(), keep.cpu()
        return [{"prompt_embeds": embeds[i], "attention_mask": keep[i]} for i in range(len(texts))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.ChromaTransformer2DModel, "transformer")

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        b, c, h, w = latents.shape
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)
        packed = diffusers.ChromaPipeline._pack_latents(noisy, b, c, h, w)
        img_ids = diffusers.ChromaPipeline._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
        embeds = text["prompt_embeds"].to(latents.device, latents.dtype)
        txt_ids = torch.zeros(embeds.shape[1], 3, dtype=latents.dtype, device=latents.device)
        # no attention mask: the text-to-image pipeline passes none (module docstring)
        pred = transformer(hidden_states=packed, timestep=(timesteps / 1000).to(latents.dtype),
                           encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        pred = diffusers.ChromaPipeline._unpack_latents(pred, height=h * 8, width=w * 8, vae_scale_factor=8)
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # Real CFG at `guidance` when it is above 1 (the pipeline's do_classifier_free_guidance), against the
        # prompt's negative or the cached empty prompt; `true_cfg` is unused (Chroma has no distilled guidance)
        def embeds(d, prefix):
            d = on_pipeline_device(pipe, d)
            return {f"{prefix}prompt_embeds": d["prompt_embeds"][None].to(self.dtype),
                    f"{prefix}prompt_attention_mask": d["attention_mask"][None].to(self.dtype)}

        kwargs = embeds(prompt, "")
        if guidance > 1:
            kwargs.update(embeds(negative if negative is not None else empty, "negative_"))
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(**kwargs, width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil").images[0]
