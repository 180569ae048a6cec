"""A tiny, deterministic SD3 pipeline built offline from real diffusers/transformers classes (conventions:
tasks/models/tiny/common.py)."""
from __future__ import annotations

from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

from tasks.models.tiny.common import (
    CLIP_ARCH, VAE_ARCH, clip_tokenizer, clip_tokenizer_2, make_clip, make_vae, resolve_arch, seeder,
    t5_tokenizer,
)


SD3_ARCH: dict = {
    # SD3Transformer2DModel; joint_attention_dim = t5_d_model, pooled_projection_dim = sum of the CLIP projections
    "sample_size": 8, "patch_size": 2, "num_layers": 1, "attention_head_dim": 8, "num_attention_heads": 4,
    "caption_projection_dim": 32,
    **VAE_ARCH, **CLIP_ARCH, "clip_projection_dim": 32, "clip_2_hidden_size": 32, "clip_2_projection_dim": 32,
    # T5EncoderModel (text_encoder_3)
    # d_model 64 = the two CLIP hidden sizes: SD3 zero-pads CLIP states to the T5 width, as in the real model
    # (a narrower T5 would truncate text_encoder_2's states away).
    "t5_d_model": 64, "t5_d_kv": 8, "t5_d_ff": 37, "t5_layers": 2, "t5_heads": 4, "t5_max_length": 32,
}


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
    tokenizer, tokenizer_2, tokenizer_3 = (clip_tokenizer(a["clip_num_merges"]), clip_tokenizer_2(a),
                                           t5_tokenizer(a["t5_max_length"]))
    seeded = seeder(seed, 5)
    transformer = seeded(0, lambda: SD3Transformer2DModel(
        sample_size=a["sample_size"], patch_size=a["patch_size"], in_channels=a["latent_channels"],
        out_channels=a["latent_channels"], num_layers=a["num_layers"], attention_head_dim=a["attention_head_dim"],
        num_attention_heads=a["num_attention_heads"], caption_projection_dim=a["caption_projection_dim"],
        joint_attention_dim=a["t5_d_model"], pooled_projection_dim=a["clip_projection_dim"] + a["clip_2_projection_dim"],
    ))
    vae = seeded(1, lambda: make_vae(a, scaling_factor=1.5305, shift_factor=0.0609, quant_conv=False))  # SD3 VAE values
    text_encoder = seeded(2, lambda: make_clip(CLIPTextModelWithProjection, a, tokenizer,
                                           a["clip_hidden_size"], a["clip_projection_dim"]))
    text_encoder_2 = seeded(3, lambda: make_clip(CLIPTextModelWithProjection, a, tokenizer_2,
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

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
LEARNS = {"tiny_sd3": {
    "arch": {"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 8, "caption_projection_dim": 128},
    "rank": 16, "steps": 300, "lr": 3e-3, "targets": [f"{m}.{p}" for m, ps in (
        ("attn", ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
        ("ff", ("net.0.proj", "net.2")), ("ff_context", ("net.0.proj", "net.2"))) for p in ps]}}
