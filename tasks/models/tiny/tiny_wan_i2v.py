"""Tiny, deterministic Wan image-to-video pipelines built offline from the real diffusers/transformers classes, in
the layouts of the released Diffusers repositories (same conventions as tiny_wan.py, whose WAN_ARCH they share):

- Wan 2.1 I2V (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers): WanImageToVideoPipeline with a CLIPVisionModel and its
  CLIPImageProcessor; the transformer takes 36 channels (16 noisy + 4 mask + 16 first-frame latent) and the CLIP
  image states (image_dim = the CLIP width, added_kv_proj_dim = the transformer's width, as 1280 / 5120 in 14B).
- Wan 2.2 I2V (Wan-AI/Wan2.2-I2V-A14B-Diffusers): the same 36-channel transformer as two experts, no image
  encoder, boundary_ratio 0.9.
- Wan 2.2 TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers): one 48-channel transformer on the Wan 2.2 VAE (z_dim 48,
  /16 in space: 2x2 patchified pixels and three downsamples, residual), saved as the repository is (WanPipeline,
  expand_timesteps=true); WanImageToVideoPipeline loads the same folder for image-to-video."""
from __future__ import annotations

from pathlib import Path

from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_wan import LEARNS as WAN_LEARNS
from tasks.models.tiny.tiny_wan import WAN_ARCH, wan_parts

I2V_ARCH: dict = {**WAN_ARCH, "boundary_ratio": 0.9,  # Wan2.2-I2V-A14B's model_index.json
                  # CLIPVisionModel: 32 px in 8 px patches (16 tokens + class), the pipeline's processor at 32 px
                  "clip_width": 16, "clip_layers": 2, "clip_heads": 2, "clip_image_size": 32, "clip_patch": 8}

# Wan2.2_VAE's latent statistics (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: latents_mean, latents_std)
WAN22_VAE_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
WAN22_VAE_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]


def _transformer(a: dict, in_channels: int, out_channels: int, **extra):
    from diffusers import WanTransformer3DModel

    return lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=a["num_attention_heads"], attention_head_dim=a["attention_head_dim"],
        in_channels=in_channels, out_channels=out_channels, text_dim=a["t5_d_model"], freq_dim=a["freq_dim"],
        ffn_dim=a["ffn_dim"], num_layers=a["num_layers"], cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=a["rope_max_seq_len"], **extra)


def build_tiny_wan_i2v(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny Wan 2.1 I2V: `WanImageToVideoPipeline` with its CLIP image encoder."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    a = resolve_arch(I2V_ARCH, arch)
    seeded = seeder(seed, 5)
    parts = wan_parts(a, seeded)
    width = a["num_attention_heads"] * a["attention_head_dim"]
    parts["transformer"] = seeded(2, _transformer(a, 36, 16, image_dim=a["clip_width"], added_kv_proj_dim=width))
    image_encoder = seeded(4, lambda: CLIPVisionModel(CLIPVisionConfig(
        hidden_size=a["clip_width"], intermediate_size=4 * a["clip_width"], num_hidden_layers=a["clip_layers"],
        num_attention_heads=a["clip_heads"], image_size=a["clip_image_size"], patch_size=a["clip_patch"])))
    size = a["clip_image_size"]
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    WanImageToVideoPipeline(**parts, image_encoder=image_encoder, image_processor=processor).save_pretrained(
        out_dir, safe_serialization=True)
    return Path(out_dir)


def build_tiny_wan22_i2v(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny Wan 2.2 I2V-A14B: two 36-channel experts, no image encoder."""
    from diffusers import WanImageToVideoPipeline

    a = resolve_arch(I2V_ARCH, arch)
    seeded = seeder(seed, 5)
    parts = wan_parts(a, seeded)
    build = _transformer(a, 36, 16)
    parts.update(transformer=seeded(2, build), transformer_2=seeded(3, build))
    WanImageToVideoPipeline(**parts, boundary_ratio=a["boundary_ratio"]).save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def build_tiny_wan22_ti2v(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny Wan 2.2 TI2V-5B: a 48-channel transformer on the /16 Wan 2.2 VAE, expand_timesteps."""
    from diffusers import AutoencoderKLWan, WanPipeline

    a = resolve_arch(I2V_ARCH, arch)
    seeded = seeder(seed, 5)
    parts = wan_parts(a, seeded)
    # the Wan 2.2 VAE's shape (diffusers' Wan225B fast test) with its published per-channel statistics (as the
    # Wan 2.1 tiny VAE keeps AutoencoderKLWan's defaults, Wan 2.1's)
    parts["vae"] = seeded(1, lambda: AutoencoderKLWan(
        base_dim=a["vae_base_dim"], z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
        latents_mean=WAN22_VAE_MEAN, latents_std=WAN22_VAE_STD,
        dim_mult=list(a["vae_dim_mult"]), num_res_blocks=a["vae_num_res_blocks"], scale_factor_spatial=16,
        scale_factor_temporal=4, temperal_downsample=[False, True, True]))
    parts["transformer"] = seeded(2, _transformer(a, 48, 48))
    WanPipeline(**parts, expand_timesteps=True).save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# Image-to-video (issue 47): Wan's clip, trained from its first frame (decoded from the mp4, as loraflow reads it)
# and rendered by WanImageToVideoPipeline from that frame (--i in the prompts file)
LEARNS = {"tiny_wan_i2v": {**WAN_LEARNS["tiny_wan"], "i2v": True},
          "tiny_wan22_i2v+both": {**WAN_LEARNS["tiny_wan22+both"], "i2v": True},
          # Wan 2.2 TI2V-5B: its /16 VAE has 48 channels, so at 64 px a frame is 2x2 tokens of 192 values each, and
          # a tiny random base must learn to denoise all of them through the LoRA. Measured ratios (2026-11-27, 2
          # cores): 0.74 at Wan 2.1's settings (192 wide, 600 steps), 0.50 at 384 wide, 0.33 at 768 wide (1200
          # steps, lr 3e-3), 0.13 with 4 blocks of 768: the tiny model's capacity (the real 5B is 3072 wide, 30
          # blocks), not the conditioning
          "tiny_wan22_ti2v": {"arch": {"num_attention_heads": 32, "attention_head_dim": 24, "ffn_dim": 1024,
                                       "num_layers": 4}, "rank": 16, "steps": 1200, "lr": 3e-3, "clip": True,
                              "i2v": True}}
