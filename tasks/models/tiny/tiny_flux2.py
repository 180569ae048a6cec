"""A tiny, deterministic FLUX.2 [klein] pipeline (Qwen3 text encoder) built offline from real diffusers/transformers
classes; its image parts are FLUX.2 [dev]'s too (tiny_flux2_dev.py). Conventions: tasks/models/tiny/common.py."""
from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from transformers import Qwen3Config

from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_zimage import qwen_tokenizer


FLUX2_ARCH: dict = {
    # Flux2Transformer2DModel (FLUX.2 [klein] layout: no guidance embedding); joint_attention_dim = 3 x
    # qwen_hidden_size (the pipeline stacks Qwen3's hidden states 9, 18 and 27); axes_dims_rope: 4 axes
    # (T, H, W, L) summing to attention_head_dim
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "axes_dims_rope": (4, 4, 4, 4),
    # AutoencoderKLFlux2: 4 blocks -> /8 as the real one, then 2x2 patches normalised by its batch norm
    "latent_channels": 4, "vae_block_out_channels": (8, 16, 16, 16), "vae_layers_per_block": 1,
    "vae_norm_num_groups": 8,
    # Qwen3ForCausalLM: 28 layers, because the pipeline reads hidden states 9, 18 and 27 (Qwen3-4B has 36)
    "qwen_hidden_size": 16, "qwen_layers": 28, "qwen_heads": 2, "qwen_kv_heads": 1, "qwen_head_dim": 8,
    "qwen_intermediate_size": 16, "qwen_num_merges": 300,
}


def flux2_image_parts(a: dict, seeded, joint_attention_dim: int, guidance_embeds: bool):
    """The FLUX.2 transformer (seed slot 0), AutoencoderKLFlux2 (slot 1) and scheduler, shared by [klein] and
    [dev]: they differ in the text encoder, its width (joint_attention_dim) and the guidance embedding."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    transformer = seeded(0, lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * a["latent_channels"], num_layers=a["num_layers"],
        num_single_layers=a["num_single_layers"], attention_head_dim=a["attention_head_dim"],
        num_attention_heads=a["num_attention_heads"], joint_attention_dim=joint_attention_dim,
        timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=tuple(a["axes_dims_rope"]), rope_theta=2000,
        guidance_embeds=guidance_embeds,
    ))
    n = len(a["vae_block_out_channels"])
    vae = seeded(1, lambda: AutoencoderKLFlux2(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(a["vae_block_out_channels"]), layers_per_block=a["vae_layers_per_block"],
        norm_num_groups=a["vae_norm_num_groups"], sample_size=64, patch_size=(2, 2),
    ))
    with torch.no_grad():  # batch-norm statistics as a trained VAE has them (fresh ones are 0 / 1)
        c = vae.bn.num_features
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, c))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, c))
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2's: the pipeline passes its empirical mu
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )
    return transformer, vae, scheduler


def build_tiny_flux2(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `Flux2KleinPipeline` (FLUX.2 [klein] layout: Qwen3 text encoder) saved in
    diffusers layout under `out_dir`. Keys of `FLUX2_ARCH`. Images are multiples of 16 px; call with e.g.
    height/width 64 and `max_sequence_length=32`."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    a = resolve_arch(FLUX2_ARCH, arch)
    tokenizer = qwen_tokenizer(a["qwen_num_merges"])
    seeded = seeder(seed, 4)
    transformer, vae, scheduler = flux2_image_parts(a, seeded, 3 * a["qwen_hidden_size"], guidance_embeds=False)
    text_encoder = seeded(2, lambda: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=a["qwen_hidden_size"], intermediate_size=a["qwen_intermediate_size"],
        num_hidden_layers=a["qwen_layers"], num_attention_heads=a["qwen_heads"],
        num_key_value_heads=a["qwen_kv_heads"], head_dim=a["qwen_head_dim"], max_position_embeddings=1024,
        rope_theta=1000000.0, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )))
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
LEARNS = {"tiny_flux2_klein": {"arch": {"num_attention_heads": 8, "num_layers": 2, "num_single_layers": 2},
                                "rank": 16, "steps": 300, "lr": 1e-2}}
LEARNS["tiny_flux2_klein+ref"] = {**LEARNS["tiny_flux2_klein"], "control": True}  # one reference image
