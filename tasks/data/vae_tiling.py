"""data.vae_tiling: diffusers' own tiled VAE encode in cache_latents, and what an untiled encode holds.

`encode_peak_gb` is arithmetic on the VAE's config.json (no torch: the run's preflight calls it on a no-op's path);
`apply` switches a loaded VAE's tiling on or off for one bucket size (tasks/cache_latents.py decides which)."""
from __future__ import annotations

import weakref

from tasks.config import ConfigError

GB = 1024 ** 3

# Per VAE class (config.json's `_class_name`). The encoder's peak is `factor` x its first level's activation,
# c0 x (H/p) x (W/p) x frames in flight x bytes: measured by bench/vae_tiling.py on each class's real config
# (random weights, fp32, CPU) as the peak of the bytes of tensors alive during one encode (a TorchDispatchMode
# counting each op's output storage until its last tensor is freed; weights and pixels not counted): the same at
# 128 and 256 px (LTX-2: to 512 px); figures in docs/memory.md. Kernel workspaces (cuDNN's, oneDNN's) are not in it.
#   p: pixels folded into channels before the first conv (patch_size where `patch`: LTX-2's 4, Wan 2.2's 2; FLUX.2's
#     patch_size folds the latents after the encoder)
#   frames: in flight for F frames (Wan / Qwen-Image: chunks of 4 with the causal cache; LTX-2: F + 1, its
#     causal padding; HunyuanVideo 1.5: all F)
#   tile: diffusers 0.42.1's default tile side in px (AutoencoderKL's: the config's sample_size); tile_frames:
#     where the tiled encode also tiles time (LTX-2 with use_framewise_decoding, which its _encode reads)
#   params: parameters per sum over levels of c_i^2, from the real config's count (the whole VAE is loaded)
_KL = {"factor": 5.0, "params": 138.3, "frames": lambda f: 1, "tile": None}
_WAN = {"factor": 10.2, "params": 372.2, "frames": lambda f: min(f, 4), "tile": 256, "patch": True}
KINDS = {
    "AutoencoderKL": _KL, "AutoencoderKLFlux2": _KL, "AutoencoderKLWan": _WAN, "AutoencoderKLQwenImage": _WAN,
    "AutoencoderKLLTX2Video": {"factor": 2.8, "params": 219.5, "frames": lambda f: f + 1, "tile": 512,
                               "tile_frames": 16, "patch": True},
    "AutoencoderKLHunyuanVideo15": {"factor": 7.1, "params": 516.4, "frames": lambda f: f, "tile": 256},
    # HunyuanVideo's (Kandinsky 5): bench.memory --nodes, kandinsky5_lite (768x512) and kandinsky5_i2v_pro (512x512)
    # at 33 frames, untiled 8.70 / 5.96 GiB: 2.641 / 2.641 per value of the first level; tiled (256 px) within 1 %
    "AutoencoderKLHunyuanVideo": {"factor": 2.64, "params": 406.6, "frames": lambda f: f, "tile": 256},
    # Qwen-Image 2.1's (RGBA, /16): bench.memory --nodes, qwenimage21 at 1024 px: 11.06 untiled, 11.19 a 256 px tile
    "AutoencoderKLQwenImage21": {"factor": 11.2, "params": 246.0, "frames": lambda f: min(f, 4), "tile": 256},
}
_UNKNOWN = {"factor": 10.2, "params": 516.4, "frames": lambda f: f, "tile": 256}  # the largest of the above


def level_channels(config: dict) -> list[int]:
    if config.get("block_out_channels"):
        return list(config["block_out_channels"])
    return [config.get("base_dim", 128) * m for m in config.get("dim_mult", [1, 2, 4, 4])]


def tile_px(config: dict) -> int:
    """The tile side (px) diffusers' tiled encode cuts at, or the one set on the VAE (config keys win)."""
    kind = KINDS.get(config.get("_class_name"), _UNKNOWN)
    side = config.get("tile_sample_min_size") or config.get("tile_sample_min_height") or kind["tile"] \
        or config.get("sample_size") or 512
    return int(side[0] if isinstance(side, (list, tuple)) else side)


def encode_peak_gb(vae_config: dict, width: int, height: int, frames: int, dtype: str, tiled: bool) -> float:
    """GiB one item's encode holds: the VAE's weights, its pixels and the encoder's largest activations (at
    a tile's size when tiled). `vae_config`: the VAE's config.json, plus any attributes the adapter sets when
    tiling (FamilyAdapter.vae_tiling); `dtype`: the VAE's compute dtype's name."""
    kind = KINDS.get(vae_config.get("_class_name"), _UNKNOWN)
    size = 2 if str(dtype).removeprefix("torch.") in ("bfloat16", "float16") else 4
    channels, patch = level_channels(vae_config), (kind.get("patch") and vae_config.get("patch_size")) or 1
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    pixels = 3 * width * height * frames * size
    if tiled:
        side = tile_px(vae_config)
        width, height = min(width, side), min(height, side)
        if kind.get("tile_frames") and vae_config.get("use_framewise_decoding"):
            frames = min(frames, vae_config.get("tile_sample_min_num_frames", kind["tile_frames"]) + 1)
    activations = kind["factor"] * channels[0] * (width / patch) * (height / patch) * kind["frames"](frames) * size
    weights = kind["params"] * sum(c * c for c in channels) * size
    return (weights + pixels + activations) / GB


_UNTILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a VAE's own values of what tiling sets


def apply(vae, tiled: bool, settings: dict) -> None:
    """diffusers' tiling on (then `settings`, attributes of the VAE such as tile sizes or temporal tiling, set on
    it) or off (and those attributes back as they were): a VAE kept between runs (load_once) is set every time."""
    saved = _UNTILED.setdefault(vae, {})
    for name in settings:
        saved.setdefault(name, getattr(vae, name, None))
    if not tiled:
        if getattr(vae, "use_tiling", False):
            vae.disable_tiling()
        for name, value in saved.items():
            setattr(vae, name, value)
        return
    try:
        vae.enable_tiling()
    except (NotImplementedError, AttributeError) as e:
        raise ConfigError(f"data.vae_tiling: {type(vae).__name__} has no tiled encode in diffusers ({e}); "
                          "set data.vae_tiling=untiled") from e
    for name, value in settings.items():
        setattr(vae, name, value)
