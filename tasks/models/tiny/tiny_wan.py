"""Tiny, deterministic Wan 2.1 / Wan 2.2 pipelines built offline from the real diffusers/transformers classes:
WanTransformer3DModel, AutoencoderKLWan (the causal video VAE: /8 in space, /4 in time, 1 + 4k frames),
UMT5EncoderModel with a T5 tokenizer, and the UniPC flow scheduler Wan's repositories ship. Same conventions as
common.py: weights depend only on `seed`, `arch` overrides keys of WAN_ARCH, the caller's RNG is left alone.

Wan 2.2 (A14B): two transformers of the same shape, `transformer` for the high-noise steps (t >= boundary_ratio x
1000) and `transformer_2` for the rest, as diffusers' WanPipeline switches between them (boundary_ratio 0.875 in
Wan-AI/Wan2.2-T2V-A14B-Diffusers)."""
from __future__ import annotations

from pathlib import Path

from tasks.models.tiny.common import t5_tokenizer
from tasks.models.tiny.common import resolve_arch, seeder

WAN_ARCH: dict = {
    # WanTransformer3DModel (diffusers' own fast-test sizes); text_dim = the UMT5 width
    "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 12, "ffn_dim": 32, "freq_dim": 256,
    "rope_max_seq_len": 32,
    # AutoencoderKLWan: z_dim 16 latents (Wan 2.1's), three spatial and two temporal downsamples
    "vae_base_dim": 3, "vae_dim_mult": (1, 1, 1, 1), "vae_num_res_blocks": 1,
    # UMT5EncoderModel
    "t5_d_model": 32, "t5_d_kv": 8, "t5_d_ff": 37, "t5_layers": 2, "t5_heads": 4, "t5_max_length": 64,
    "flow_shift": 3.0,  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers' scheduler (5.0 for 720p)
    "boundary_ratio": 0.875,  # Wan 2.2 only
}


def wan_parts(a: dict, seeded) -> dict:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(a["t5_max_length"])
    text_encoder = seeded(0, lambda: UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=a["t5_d_model"], d_kv=a["t5_d_kv"], d_ff=a["t5_d_ff"],
        num_layers=a["t5_layers"], num_heads=a["t5_heads"], feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)))
    vae = seeded(1, lambda: AutoencoderKLWan(
        base_dim=a["vae_base_dim"], z_dim=16, dim_mult=list(a["vae_dim_mult"]), num_res_blocks=a["vae_num_res_blocks"],
        temperal_downsample=[False, True, True]))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=a["flow_shift"])
    transformer = lambda: WanTransformer3DModel(  # noqa: E731
        patch_size=(1, 2, 2), num_attention_heads=a["num_attention_heads"], attention_head_dim=a["attention_head_dim"],
        in_channels=16, out_channels=16, text_dim=a["t5_d_model"], freq_dim=a["freq_dim"], ffn_dim=a["ffn_dim"],
        num_layers=a["num_layers"], cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=a["rope_max_seq_len"])
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler,
            "transformer": transformer}


def build_tiny_wan(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight Wan 2.1 `WanPipeline` saved in diffusers layout under `out_dir`."""
    from diffusers import WanPipeline

    a = resolve_arch(WAN_ARCH, arch)
    seeded = seeder(seed, 4)
    parts = wan_parts(a, seeded)
    parts["transformer"] = seeded(2, parts["transformer"])
    WanPipeline(**parts).save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def build_tiny_wan22(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight Wan 2.2 (A14B layout) `WanPipeline`: two experts and the boundary between them."""
    from diffusers import WanPipeline

    a = resolve_arch(WAN_ARCH, arch)
    seeded = seeder(seed, 4)
    parts = wan_parts(a, seeded)
    build = parts.pop("transformer")
    WanPipeline(**parts, transformer=seeded(2, build), transformer_2=seeded(3, build),
                boundary_ratio=a["boundary_ratio"]).save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# Wan 2.1: one 9-frame clip (the demo image sliding right), rendered by WanPipeline at 9 frames; every Linear of
# its blocks is a default target already
LEARNS = {"tiny_wan": {"arch": {"num_attention_heads": 8, "attention_head_dim": 24, "ffn_dim": 256}, "rank": 16,
                       "steps": 600, "lr": 1e-2, "clip": True}}
# Wan 2.2, one LoRA on both experts (model.expert=both): the same clip, the file loaded into both experts
LEARNS["tiny_wan22+both"] = {**LEARNS["tiny_wan"], "expert": "both", "steps": 900}
