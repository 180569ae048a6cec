"""Tiny, deterministic SD3 / SDXL / SD1.5 pipelines built offline from real diffusers/transformers classes.

Companions of `build_tiny_flux` (tasks/models/tiny.py), with the same conventions: weights depend only on
`seed` (same seed -> byte-identical files), the caller's global torch RNG is untouched, `arch` overrides
keys of the family's `*_ARCH` defaults (unknown key -> ValueError), and tokenizers come from tiny.py's
fixed-vocabulary builders (tokenizers' trainers are not deterministic). Dimensions that must agree
between components (pooled/cross-attention/add-embedding sizes) are derived, not separate arch keys,
so any override stays a consistent model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
    StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from tasks.models.tiny import clip_tokenizer, t5_tokenizer

# Shared by all three families: AutoencoderKL with 4 blocks (vae_scale_factor 8, like the real models)
# and the CLIP text tower(s). CLIP layers >= 2 because SD3/SDXL read the penultimate hidden state.
VAE_ARCH = {"latent_channels": 4, "vae_block_out_channels": (8, 16, 16, 16), "vae_layers_per_block": 1,
             "vae_norm_num_groups": 8}
_CLIP_ARCH = {"clip_hidden_size": 32, "clip_layers": 2, "clip_heads": 2, "clip_intermediate_size": 37,
              "clip_num_merges": 300}

SD3_ARCH: dict = {
    # SD3Transformer2DModel; joint_attention_dim = t5_d_model, pooled_projection_dim = sum of the CLIP projections
    "sample_size": 8, "patch_size": 2, "num_layers": 1, "attention_head_dim": 8, "num_attention_heads": 4,
    "caption_projection_dim": 32,
    **VAE_ARCH, **_CLIP_ARCH, "clip_projection_dim": 32, "clip_2_hidden_size": 32, "clip_2_projection_dim": 32,
    # T5EncoderModel (text_encoder_3)
    # d_model 64 = the two CLIP hidden sizes: SD3 zero-pads CLIP states to the T5 width, as in the real model
    # (a narrower T5 would truncate text_encoder_2's states away).
    "t5_d_model": 64, "t5_d_kv": 8, "t5_d_ff": 37, "t5_layers": 2, "t5_heads": 4, "t5_max_length": 32,
}
SDXL_ARCH: dict = {
    # UNet2DConditionModel as in diffusers' SDXL fast tests. cross_attention_dim = clip_hidden_size +
    # clip_2_hidden_size (64); projection_class_embeddings_input_dim = 6 * addition_time_embed_dim +
    # clip_2_projection_dim (80: six add_time_ids, each sinusoidally embedded, plus the pooled text_embeds).
    "sample_size": 32, "block_out_channels": (32, 64), "layers_per_block": 2, "attention_head_dim": (2, 4),
    "transformer_layers_per_block": (1, 2), "addition_time_embed_dim": 8, "norm_num_groups": 32,
    **VAE_ARCH, **_CLIP_ARCH, "clip_2_hidden_size": 32, "clip_2_projection_dim": 32,
}
SD15_ARCH: dict = {
    # UNet2DConditionModel; cross_attention_dim = clip_hidden_size (32). sample_size 8 -> 64 px by default.
    "sample_size": 8, "block_out_channels": (32, 64), "layers_per_block": 1, "attention_head_dim": 8,
    "norm_num_groups": 32,
    **VAE_ARCH, **_CLIP_ARCH,
}


def resolve_arch(defaults: dict, arch: dict | None) -> dict:
    unknown = set(arch or {}) - set(defaults)
    if unknown:
        raise ValueError(f"unknown arch keys: {sorted(unknown)}")
    return {**defaults, **(arch or {})}


def seeder(seed: int, n: int):
    """Returns `seeded(i, build)`: runs `build` under component i's own seed (so resizing one component
    leaves the others' weights alone), inside fork_rng so the caller's global RNG is untouched."""
    seeds = torch.randint(0, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def seeded(i: int, build):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeds[i])
            return build()
    return seeded


def _vae(a: dict, scaling_factor: float, shift_factor: float | None = None, quant_conv: bool = True) -> AutoencoderKL:
    n = len(a["vae_block_out_channels"])
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(a["vae_block_out_channels"]), layers_per_block=a["vae_layers_per_block"],
        norm_num_groups=a["vae_norm_num_groups"], sample_size=64, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=quant_conv, use_post_quant_conv=quant_conv,
    )


def _clip(cls, a: dict, tokenizer, hidden_size: int, projection_dim: int):
    return cls(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=a["clip_intermediate_size"],
        num_hidden_layers=a["clip_layers"], num_attention_heads=a["clip_heads"], max_position_embeddings=77,
        projection_dim=projection_dim,
        # the pooled output is taken at the first eos token, so the ids must match the tokenizer's
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))


def _clip_tokenizer_2(a: dict):
    """SDXL's and SD3's second CLIP tokenizer pads with "!" (id of a byte token), not with <|endoftext|>."""
    tokenizer = clip_tokenizer(a["clip_num_merges"])
    tokenizer.pad_token = "!"
    return tokenizer


def _sd_betas() -> dict:
    """The SD1.x / SDXL training noise schedule."""
    return dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                steps_offset=1)


def build_tiny_sd3(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `StableDiffusion3Pipeline` saved in diffusers layout under `out_dir`.

    Keys of `SD3_ARCH`: transformer (sample_size, patch_size, num_layers, attention_head_dim,
    num_attention_heads, caption_projection_dim), VAE (latent_channels, vae_*), two
    CLIPTextModelWithProjection (clip_* shared, clip_hidden_size/clip_projection_dim for the first,
    clip_2_hidden_size/clip_2_projection_dim for the second), T5 (t5_*). Defaults give 64 px images;
    call with `max_sequence_length=a["t5_max_length"]` (32). Note: SD3 pads the concatenated CLIP hidden
    states (clip_hidden_size + clip_2_hidden_size = 64) to t5_d_model with F.pad; the default
    t5_d_model 64 keeps the real models' behaviour (diffusers' fast tests use 32, where the pad is
    negative and truncates text_encoder_2's states away).
    """
    a = resolve_arch(SD3_ARCH, arch)
    tokenizer, tokenizer_2, tokenizer_3 = (clip_tokenizer(a["clip_num_merges"]), _clip_tokenizer_2(a),
                                           t5_tokenizer(a["t5_max_length"]))
    seeded = seeder(seed, 5)
    transformer = seeded(0, lambda: SD3Transformer2DModel(
        sample_size=a["sample_size"], patch_size=a["patch_size"], in_channels=a["latent_channels"],
        out_channels=a["latent_channels"], num_layers=a["num_layers"], attention_head_dim=a["attention_head_dim"],
        num_attention_heads=a["num_attention_heads"], caption_projection_dim=a["caption_projection_dim"],
        joint_attention_dim=a["t5_d_model"], pooled_projection_dim=a["clip_projection_dim"] + a["clip_2_projection_dim"],
    ))
    vae = seeded(1, lambda: _vae(a, scaling_factor=1.5305, shift_factor=0.0609, quant_conv=False))  # SD3 VAE values
    text_encoder = seeded(2, lambda: _clip(CLIPTextModelWithProjection, a, tokenizer,
                                           a["clip_hidden_size"], a["clip_projection_dim"]))
    text_encoder_2 = seeded(3, lambda: _clip(CLIPTextModelWithProjection, a, tokenizer_2,
                                             a["clip_2_hidden_size"], a["clip_2_projection_dim"]))
    text_encoder_3 = seeded(4, lambda: T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_3), d_model=a["t5_d_model"], d_kv=a["t5_d_kv"], d_ff=a["t5_d_ff"],
        num_layers=a["t5_layers"], num_heads=a["t5_heads"], feed_forward_proj="gated-gelu",  # T5 v1.1, as in SD3
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2, text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
        image_encoder=None, feature_extractor=None,  # IP-adapter parts (SD3.5), not used here
    )
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_tiny_sdxl(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `StableDiffusionXLPipeline` saved in diffusers layout under `out_dir`.

    Keys of `SDXL_ARCH`: UNet (sample_size, block_out_channels, layers_per_block, attention_head_dim
    [= heads per block, diffusers' legacy name], transformer_layers_per_block, addition_time_embed_dim,
    norm_num_groups), VAE (latent_channels, vae_*), CLIPTextModel (clip_*) and
    CLIPTextModelWithProjection (clip_2_hidden_size, clip_2_projection_dim; other clip_* shared).
    The default UNet sample_size 32 means a 256 px default resolution: pass height/width (e.g. 64).
    """
    a = resolve_arch(SDXL_ARCH, arch)
    tokenizer, tokenizer_2 = clip_tokenizer(a["clip_num_merges"]), _clip_tokenizer_2(a)
    seeded = seeder(seed, 4)
    unet = seeded(0, lambda: UNet2DConditionModel(
        sample_size=a["sample_size"], in_channels=a["latent_channels"], out_channels=a["latent_channels"],
        block_out_channels=tuple(a["block_out_channels"]), layers_per_block=a["layers_per_block"],
        # SDXL's first level has no attention; the deeper ones cross-attend to the text
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(a["block_out_channels"]) - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (len(a["block_out_channels"]) - 1) + ("UpBlock2D",),
        attention_head_dim=tuple(a["attention_head_dim"]), use_linear_projection=True,
        transformer_layers_per_block=tuple(a["transformer_layers_per_block"]), norm_num_groups=a["norm_num_groups"],
        cross_attention_dim=a["clip_hidden_size"] + a["clip_2_hidden_size"],  # both encoders' hidden states, concatenated
        addition_embed_type="text_time", addition_time_embed_dim=a["addition_time_embed_dim"],
        projection_class_embeddings_input_dim=6 * a["addition_time_embed_dim"] + a["clip_2_projection_dim"],
    ))
    vae = seeded(1, lambda: _vae(a, scaling_factor=0.13025))  # SDXL VAE value
    text_encoder = seeded(2, lambda: _clip(CLIPTextModel, a, tokenizer, a["clip_hidden_size"], a["clip_hidden_size"]))
    text_encoder_2 = seeded(3, lambda: _clip(CLIPTextModelWithProjection, a, tokenizer_2,
                                             a["clip_2_hidden_size"], a["clip_2_projection_dim"]))
    scheduler = EulerDiscreteScheduler(**_sd_betas(), timestep_spacing="leading")  # SDXL base scheduler config
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler,
        # not saved in model_index.json: from_pretrained re-enables it iff invisible-watermark is installed
        add_watermarker=False,
    )
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_tiny_sd15(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `StableDiffusionPipeline` (SD1.5 layout, no safety checker) under `out_dir`.

    Keys of `SD15_ARCH`: UNet (sample_size, block_out_channels, layers_per_block, attention_head_dim
    [= heads], norm_num_groups), VAE (latent_channels, vae_*), CLIPTextModel (clip_*). Defaults give
    64 px images.
    """
    a = resolve_arch(SD15_ARCH, arch)
    tokenizer = clip_tokenizer(a["clip_num_merges"])
    seeded = seeder(seed, 3)
    n = len(a["block_out_channels"])
    unet = seeded(0, lambda: UNet2DConditionModel(
        sample_size=a["sample_size"], in_channels=a["latent_channels"], out_channels=a["latent_channels"],
        block_out_channels=tuple(a["block_out_channels"]), layers_per_block=a["layers_per_block"],
        # SD1.5: cross-attention at every level but the deepest
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        attention_head_dim=a["attention_head_dim"], norm_num_groups=a["norm_num_groups"],
        cross_attention_dim=a["clip_hidden_size"],
    ))
    vae = seeded(1, lambda: _vae(a, scaling_factor=0.18215))  # SD1.x VAE value
    text_encoder = seeded(2, lambda: _clip(CLIPTextModel, a, tokenizer, a["clip_hidden_size"], a["clip_hidden_size"]))
    # DDIM with SD1.5's betas: exact for any step count (PNDM's PLMS warm-up makes 2 steps odd)
    scheduler = DDIMScheduler(**_sd_betas(), clip_sample=False, set_alpha_to_one=False)
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
