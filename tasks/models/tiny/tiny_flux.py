"""A tiny, deterministic Flux pipeline (and FLUX.1 Kontext's) built offline from real diffusers/transformers classes:
the same architecture and code paths as FLUX.1-dev, a few hundred kB on disk (conventions: tasks/models/tiny/common.py)."""
from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from tasks.models.tiny.common import clip_tokenizer, t5_tokenizer


DEFAULT_ARCH: dict = {
    # FluxTransformer2DModel (guidance_embeds=True, like flux-dev)
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "axes_dims_rope": (4, 6, 6),  # must sum to attention_head_dim
    # AutoencoderKL: 4 blocks -> vae_scale_factor 8, as in real Flux
    "latent_channels": 4, "vae_block_out_channels": (8, 16, 16, 16), "vae_layers_per_block": 1,
    "vae_norm_num_groups": 8,
    # CLIPTextModel (its hidden size is the transformer's pooled_projection_dim)
    "clip_hidden_size": 32, "clip_layers": 2, "clip_heads": 2, "clip_intermediate_size": 37,
    "clip_num_merges": 300,
    # T5EncoderModel (its d_model is the transformer's joint_attention_dim)
    "t5_d_model": 32, "t5_d_kv": 8, "t5_d_ff": 37, "t5_layers": 2, "t5_heads": 4,
    "t5_max_length": 32,
}


def build_tiny_flux(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Build a tiny random-weight Flux pipeline and save it in diffusers layout under `out_dir`.

    Weights depend only on `seed` (same seed -> byte-identical files); the global torch RNG of the
    caller is left untouched. `arch` overrides keys of `DEFAULT_ARCH` (transformer: num_layers,
    num_single_layers, attention_head_dim, num_attention_heads, axes_dims_rope; VAE: latent_channels,
    vae_block_out_channels, vae_layers_per_block, vae_norm_num_groups; CLIP: clip_hidden_size,
    clip_layers, clip_heads, clip_intermediate_size, clip_num_merges; T5: t5_d_model, t5_d_kv, t5_d_ff,
    t5_layers, t5_heads, t5_max_length). Load with `FluxPipeline.from_pretrained(out_dir)`
    and call it with `max_sequence_length=a["t5_max_length"]` (32 by default), height/width 64.
    """
    unknown = set(arch or {}) - set(DEFAULT_ARCH)
    if unknown:
        raise ValueError(f"unknown arch keys: {sorted(unknown)}")
    a = {**DEFAULT_ARCH, **(arch or {})}
    out_dir = Path(out_dir)
    tokenizer, tokenizer_2 = clip_tokenizer(a["clip_num_merges"]), t5_tokenizer(a["t5_max_length"])

    # One seed per component, drawn from a generator seeded with `seed`: changing one component's
    # sizes does not change the others' weights. fork_rng keeps the caller's global RNG intact.
    component_seeds = torch.randint(0, 2**31 - 1, (4,), generator=torch.Generator().manual_seed(seed)).tolist()

    def seeded(i: int, build):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(component_seeds[i])
            return build()

    transformer = seeded(0, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=4 * a["latent_channels"],  # 2x2 latent patches packed into channels
        num_layers=a["num_layers"], num_single_layers=a["num_single_layers"],
        attention_head_dim=a["attention_head_dim"], num_attention_heads=a["num_attention_heads"],
        joint_attention_dim=a["t5_d_model"], pooled_projection_dim=a["clip_hidden_size"],
        guidance_embeds=True, axes_dims_rope=tuple(a["axes_dims_rope"]),
    ))
    n_blocks = len(a["vae_block_out_channels"])
    vae = seeded(1, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        down_block_types=("DownEncoderBlock2D",) * n_blocks, up_block_types=("UpDecoderBlock2D",) * n_blocks,
        block_out_channels=tuple(a["vae_block_out_channels"]), layers_per_block=a["vae_layers_per_block"],
        norm_num_groups=a["vae_norm_num_groups"], sample_size=64,
        scaling_factor=0.3611, shift_factor=0.1159,  # FLUX.1 VAE values
        use_quant_conv=False, use_post_quant_conv=False,  # Flux's VAE has neither
    ))
    text_encoder = seeded(2, lambda: CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=a["clip_hidden_size"], intermediate_size=a["clip_intermediate_size"],
        num_hidden_layers=a["clip_layers"], num_attention_heads=a["clip_heads"], max_position_embeddings=77,
        projection_dim=a["clip_hidden_size"],
        # the pooled output is taken at the first eos token, so the ids must match the tokenizer's
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )))
    text_encoder_2 = seeded(3, lambda: T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=a["t5_d_model"], d_kv=a["t5_d_kv"], d_ff=a["t5_d_ff"],
        num_layers=a["t5_layers"], num_heads=a["t5_heads"], feed_forward_proj="gated-gelu",  # T5 v1.1, as in Flux
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )))
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev scheduler config
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_tiny_flux_kontext(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """The tiny Flux of `build_tiny_flux` as a FLUX.1 Kontext pipeline folder: Kontext has FLUX.1's components
    and architecture (its transformer learns to read the control image's tokens), so only the pipeline class
    in model_index.json differs. Load with `FluxKontextPipeline.from_pretrained(out_dir)`."""
    import json

    out_dir = build_tiny_flux(out_dir, seed=seed, arch=arch)
    index = out_dir / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "FluxKontextPipeline"}, indent=2))
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
LEARNS = {"tiny_flux": {"arch": {"num_attention_heads": 8}, "rank": 16, "steps": 300, "lr": 1e-3}}
# FLUX.1 Kontext: one (control, target) pair, the control the target's negative; rendered with the control
LEARNS["tiny_flux_kontext"] = {**LEARNS["tiny_flux"], "control": True}
