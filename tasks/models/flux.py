"""Flux: CLIP-L pooled + T5 sequence, 16x16 latent patches (VAE /8, packed 2x2), flow matching."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import BLOCK as _B, SINGLE as _S, KohyaLayout
from tasks.models.bases.flow_matching import TransformerAdapter, noise_latents, weighted_loss
from tasks.models.bases.real_size import RealSize

torch = lazy("torch")
diffusers = lazy("diffusers")
transformers = lazy("transformers")

# use_safetensors=True: never fall back to pickled .bin weights.
_SAFE = dict(use_safetensors=True)
_TextEncoders = SimpleNamespace  # tokenizer, tokenizer_2, text_encoder, text_encoder_2
log = logging.getLogger("loraflow")
_WARNED: set[str] = set()  # texts already warned about (training may encode a caption every step)
_SAMPLE_PARTS = dict(text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None, **_SAFE)


# The kohya file's names: BFL's (networks.lora_flux's layout; sd-scripts, ComfyUI, Forge and diffusers' FluxPipeline
# load it). diffusers module (full match) -> (kohya module, group size: q|k|v fused in qkv, q|k|v|mlp in linear1)
KOHYA_RULES = (
    (_B + r"attn\.to_([qkv])", "double_blocks_{}_img_attn_qkv", 3),
    (_B + r"attn\.add_([qkv])_proj", "double_blocks_{}_txt_attn_qkv", 3),
    (_B + r"attn\.to_out\.0", "double_blocks_{}_img_attn_proj", 1),
    (_B + r"attn\.to_add_out", "double_blocks_{}_txt_attn_proj", 1),
    (_B + r"ff\.net\.0\.proj", "double_blocks_{}_img_mlp_0", 1),
    (_B + r"ff\.net\.2", "double_blocks_{}_img_mlp_2", 1),
    (_B + r"ff_context\.net\.0\.proj", "double_blocks_{}_txt_mlp_0", 1),
    (_B + r"ff_context\.net\.2", "double_blocks_{}_txt_mlp_2", 1),
    (_B + r"norm1\.linear", "double_blocks_{}_img_mod_lin", 1),
    (_B + r"norm1_context\.linear", "double_blocks_{}_txt_mod_lin", 1),
    (_S + r"attn\.to_([qkv])", "single_blocks_{}_linear1", 4),
    (_S + r"(proj_mlp)", "single_blocks_{}_linear1", 4),
    (_S + r"proj_out", "single_blocks_{}_linear2", 1),
    (_S + r"norm\.linear", "single_blocks_{}_modulation_lin", 1),
    (r"x_embedder", "img_in", 1),
    (r"context_embedder", "txt_in", 1),
)


# FLUX.1-dev's transformer and VAE configs (black-forest-labs/FLUX.1-dev transformer/ and vae/config.json): the
# transformer class defaults are FLUX.1's but for the guidance embedding and RoPE axes; the VAE's are not FLUX.1's
FLUX1_DEV = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                 guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX1_VAE = dict(block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
                 up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=16, layers_per_block=2, norm_num_groups=32,
                 use_quant_conv=False, use_post_quant_conv=False, sample_size=1024, scaling_factor=0.3611,
                 shift_factor=0.1159, force_upcast=True)

class FluxAdapter(TransformerAdapter):
    swap_blocks = ("transformer_blocks", "single_transformer_blocks")  # train.blocks_to_swap, in run order
    family = "flux"
    original_layout = "flux"  # loraflow-lora merge --into-base --layout original
    # the top-level proj_out (BFL final_layer.linear): networks.lora_flux has no such module, sd-scripts' strict
    # load refuses the key
    kohya = KohyaLayout("networks.lora_flux", "flux1", rules=KOHYA_RULES, drop=r"proj_out")
    pipeline_cls = LazyClass("diffusers", "FluxPipeline")
    reference_kohya = "merge"  # diffusers' converter hard-codes FLUX.1's widths for single-block linear1
    denoiser_cls = LazyClass("diffusers", "FluxTransformer2DModel")
    denoiser_subfolder = "transformer"
    sample_parts = _SAMPLE_PARTS
    text_components = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2")

    # -- latents ---------------------------------------------------------------------------------
    def load_vae(self):
        # On the device (CUDA when there is one); the caller stores what it returns on the CPU.
        return diffusers.AutoencoderKL.from_pretrained(self.model_dir, subfolder="vae", dtype=self.dtype, **_SAFE).to(self.device).eval()

    @no_grad
    def encode_latents(self, vae, pixels):
        # The distribution's mode, not a sample: the cached item is then a pure function of its inputs.
        z = vae.encode(pixels.to(vae.device, vae.dtype, non_blocking=True)).latent_dist.mode()
        return (z - vae.config.shift_factor) * vae.config.scaling_factor

    # -- text ------------------------------------------------------------------------------------
    def load_text_encoders(self):
        # The four text parts, loaded directly as diffusers' Flux LoRA example does: a FluxPipeline around them
        # costs ~5 % of text-caching throughput (module walks per call, a second tokenization for its warning).
        # Streamed, stored as text.quantize says and placed (pretrained_text_encoder).
        return _TextEncoders(
            tokenizer=transformers.CLIPTokenizer.from_pretrained(self.model_dir, subfolder="tokenizer"),
            tokenizer_2=transformers.T5TokenizerFast.from_pretrained(self.model_dir, subfolder="tokenizer_2"),
            text_encoder=self.pretrained_text_encoder("text_encoder", transformers.CLIPTextModel),
            text_encoder_2=self.pretrained_text_encoder("text_encoder_2", transformers.T5EncoderModel))

    @no_grad
    def encode_text(self, enc, texts):
        # The computation of FluxPipeline.encode_prompt (a test holds the bytes equal): CLIP's pooled output,
        # T5's last hidden states, both in the encoder's dtype; the T5 mask kept for training's attention.
        clip_ids = enc.tokenizer(texts, padding="max_length", max_length=enc.tokenizer.model_max_length,
                                 truncation=True, return_tensors="pt").input_ids
        pooled = enc.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        ids = enc.tokenizer_2(texts, padding="max_length", max_length=self.max_sequence_length,
                              truncation=True, return_tensors="pt").input_ids
        embeds = enc.text_encoder_2(ids.to(self.device), output_hidden_states=False)[0]
        mask = (ids != enc.tokenizer_2.pad_token_id).to(torch.int64)
        for text, m in zip(texts, mask):
            if m.sum() == self.max_sequence_length and text not in _WARNED:  # a full window: maybe cut
                _WARNED.add(text)
                log.warning("text may be truncated at model.max_sequence_length=%d T5 tokens: %.80r",
                            self.max_sequence_length, text)
        embeds, pooled = embeds.to(enc.text_encoder_2.dtype).cpu(), pooled.to(enc.text_encoder.dtype).cpu()
        return [{"prompt_embeds": embeds[i], "pooled_prompt_embeds": pooled[i], "attention_mask": mask[i]}
                for i in range(len(texts))]

    # -- training --------------------------------------------------------------------------------
    def load_denoiser(self):
        return self.pretrained_denoiser(diffusers.FluxTransformer2DModel, "transformer")

    # The blocks' attention and MLP projections, by full path (a regex peft matches whole names): never the
    # top-level proj_out (the final layer), which neither diffusers' Flux LoRA example nor sd-scripts trains.
    LORA_TARGETS = (r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)"
                    r"|ff(_context)?\.net\.(0\.proj|2))"
                    r"|single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp|proj_out)")
    train_version = "2"  # 2: LoRA targets by full path, without the final layer (the LoRA's bytes changed)

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        b, c, h, w = latents.shape
        noisy, noise, timesteps, sigmas = noise_latents(latents, train_cfg, scheduler, generators)

        packed = diffusers.FluxPipeline._pack_latents(noisy, b, c, h, w)
        img_ids = diffusers.FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
        embeds = text["prompt_embeds"].to(latents.dtype)
        txt_ids = torch.zeros(embeds.shape[1], 3, dtype=latents.dtype, device=latents.device)
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((b,), float(train_cfg.guidance), dtype=latents.dtype, device=latents.device)
        pred = transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                           pooled_projections=text["pooled_prompt_embeds"].to(latents.dtype),
                           encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        vae_scale = self.size_multiple // 2
        pred = diffusers.FluxPipeline._unpack_latents(pred, height=h * vae_scale, width=w * vae_scale, vae_scale_factor=vae_scale)
        return weighted_loss(pred, noise - latents, sigmas, train_cfg)  # velocity target

    # -- sampling --------------------------------------------------------------------------------
    @no_grad
    def sample(self, pipe, prompt, negative, empty, width, height, steps, guidance, true_cfg, seed, generator_device="cpu"):
        # Flux-dev's guidance is distilled (`guidance`); real CFG only when the prompt has a negative.
        kwargs = {}
        if negative is not None:
            kwargs = dict(negative_prompt_embeds=negative["prompt_embeds"][None].to(self.dtype),
                          negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"][None].to(self.dtype),
                          true_cfg_scale=true_cfg)
        generator = self.make_generator(pipe, seed, generator_device)
        return pipe(prompt_embeds=prompt["prompt_embeds"][None].to(self.dtype),
                    pooled_prompt_embeds=prompt["pooled_prompt_embeds"][None].to(self.dtype),
                    width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                    max_sequence_length=self.max_sequence_length, generator=generator, output_type="pil",
                    **kwargs).images[0]

    # -- full size (bench.memory: tasks/models/bases/real_size.py) --------------------------------
    real_sizes = (RealSize("flux_dev", "FluxTransformer2DModel", FLUX1_DEV, vae=("AutoencoderKL", FLUX1_VAE),
                           text=(("text_encoder", "clip_l"), ("text_encoder_2", "t5_xxl")),
                           rows=("bf16+ckpt", "nf4+ckpt", "nf4+ckpt+offload+swap20", "int8+ckpt", "int8+ckpt+swap10"),
                           card=(12, 32), train_goal_gib=16),)

    @staticmethod
    def bench_batch(config, size, frames, text_len):
        # 16-channel /8 latents (packed 2x2 by training_loss); T5's states and CLIP's pooled vector
        w, h = size
        z = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
        return z(1, config["in_channels"] // 4, h // 8, w // 8), {
            "prompt_embeds": z(1, text_len, config["joint_attention_dim"]),
            "pooled_prompt_embeds": z(1, config["pooled_projection_dim"])}
