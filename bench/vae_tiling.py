"""VAE tiling (data.vae_tiling): `python -m bench.vae_tiling [--out PATH] [--quick]`, CPU, ~6 min on 2 cores.

1. factors: each VAE class on its real config (diffusers 0.42.1's defaults; AutoencoderKL: FLUX.1's), random
   weights, fp32: the peak bytes of the tensors alive during one untiled encode (LiveBytes below; weights and
   pixels not counted) over the first level's activation, and tasks/data/vae_tiling.py's estimate over the
   measured peak (its constants come from this table).
2. distances: the tiled latent (`latent_dist.mode()`, diffusers' tiled encode) against the untiled one, relative
   L2 (|t - u| / |u|) and cosine similarity, with diffusers' default tile sizes on images larger than the tile:
   - trained: the demo's pretrained VAE (data/demo_base, AutoencoderKL; tile 64 = its sample_size) on images of
     the world it was trained on;
   - quarter: each class at its real depth and tile sizes, a quarter of the real width (the real width at these
     sizes takes minutes per encode on 2 cores; group norms keep the real channels per group), random weights;
   - tiny: the tiny families' VAEs (random weights), 128 px with a 64 px tile (half-image tiles, as the tests).
   Inputs: mosaics of the demo world's images, bicubic to size (clips: the mosaic sliding 2 px a frame).
Writes bench/vae_tiling.json and prints the tables. Run with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
import weakref
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tasks.data import vae_tiling

HERE = Path(__file__).resolve().parent
MIB = 1024 ** 2


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors ops make while active: each output's storage counted once, until the last tensor
    on it is freed; `external` (weights, inputs) never counted. Allocations inside one kernel are not seen."""

    def __init__(self, external=()):
        super().__init__()
        self.ignore = {t.untyped_storage()._cdata for t in external}
        self.refs, self.sizes, self.now, self.peak = {}, {}, 0, 0

    def _drop(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.now -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.ignore:
                key = t.untyped_storage()._cdata
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                    self.now += self.sizes[key]
                    self.peak = max(self.peak, self.now)
                self.refs[key] += 1
                weakref.finalize(t, self._drop, key)
        return out


def encode(vae, x: torch.Tensor, track: bool = False) -> tuple[torch.Tensor, int]:
    """(latent_dist.mode(), peak live bytes or 0)."""
    mode = LiveBytes([*vae.parameters(), *vae.buffers(), x]) if track else None
    with torch.no_grad():
        if mode is None:
            return vae.encode(x).latent_dist.mode(), 0
        with mode:
            z = vae.encode(x).latent_dist.mode()
    return z, mode.peak


def _kl(width: int = 1, **extra) -> tuple[type, dict]:
    from diffusers import AutoencoderKL

    return AutoencoderKL, {**dict(block_out_channels=tuple(c // width for c in (128, 256, 512, 512)),
                                  layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=16,
                                  norm_num_groups=32 // width, sample_size=1024, use_quant_conv=False,
                                  use_post_quant_conv=False), **extra}


def real(name: str, width: int = 1) -> tuple[type, dict]:
    """A class and its real config (width > 1: every level's channels / width, depth and tiles kept)."""
    import diffusers

    if name in ("AutoencoderKL", "AutoencoderKL-sd15"):
        return _kl(width, **({"sample_size": 512} if name.endswith("sd15") else {}))
    cls = getattr(diffusers, name)
    # LTX-2's released config names its ratios (/32, /8); the class defaults would count the temporal-only
    # downsampling as spatial too, and its tiled encode cuts by them
    ltx = {"spatial_compression_ratio": 32, "temporal_compression_ratio": 8} if name == "AutoencoderKLLTX2Video" else {}
    if width == 1:
        return cls, ltx
    if name == "AutoencoderKLFlux2":
        return cls, dict(block_out_channels=(32, 64, 128, 128), norm_num_groups=8)
    if name in ("AutoencoderKLWan", "AutoencoderKLQwenImage"):
        return cls, dict(base_dim=96 // width)
    if name == "AutoencoderKLLTX2Video":
        return cls, dict(block_out_channels=(64, 128, 256, 512), decoder_block_out_channels=(64, 128, 256), **ltx)
    if name == "AutoencoderKLHunyuanVideo15":
        return cls, dict(block_out_channels=(32, 64, 128, 256, 256))
    raise ValueError(name)


def build(cls, kwargs, seed: int = 0):
    torch.manual_seed(seed)
    return cls(**kwargs).eval()


def world_image(width: int, height: int, shift: int = 0) -> np.ndarray:
    """A 4x4 mosaic of the demo world's images at (width, height), slid `shift` px: [H, W, 3] uint8."""
    from tasks.demo import world

    rng, colours = np.random.default_rng(0), list(world.PALETTE)
    mosaic = Image.new("RGB", (64 * 5, 64 * 4))
    for i in range(4):
        for j in range(5):
            c, b = rng.choice(len(colours), 2, replace=False)
            mosaic.paste(world.render(world.SHAPES[rng.integers(3)], colours[c], colours[b]), (64 * j, 64 * i))
    return np.asarray(mosaic.crop((shift, 0, shift + 256, 256)).resize((width, height), Image.BICUBIC))


def pixels(width: int, height: int, frames: int, video: bool) -> torch.Tensor:
    """[1, 3, H, W] (an image VAE) or [1, 3, F, H, W] in [-1, 1]."""
    arrays = [world_image(width, height, 2 * f) for f in range(max(frames, 1))]
    x = torch.from_numpy(np.stack(arrays)).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    return x if video else x[:, :, 0]


def _is_video(name: str) -> bool:
    return name not in ("AutoencoderKL", "AutoencoderKL-sd15", "AutoencoderKLFlux2")


def config_of(vae, name: str) -> dict:
    return {**dict(vae.config), "_class_name": name.split("-")[0]}


def factor_row(name: str, size: int, frames: int) -> dict:
    cls, kwargs = real(name)
    vae = build(cls, kwargs)
    x = pixels(size, size, frames, _is_video(name))
    start = time.perf_counter()
    _, peak = encode(vae, x, track=True)
    cfg, kind = config_of(vae, name), vae_tiling.KINDS[name.split("-")[0]]
    channels = vae_tiling.level_channels(cfg)
    patch = (kind.get("patch") and cfg.get("patch_size")) or 1
    level = channels[0] * (size / patch) ** 2 * kind["frames"](max(frames, 1)) * 4
    params = sum(p.numel() for p in vae.parameters())
    estimate = vae_tiling.encode_peak_gb(cfg, size, size, max(frames, 1), "float32", tiled=False) * vae_tiling.GB
    weights = vae_tiling.KINDS[name.split("-")[0]]["params"] * sum(c * c for c in channels) * 4
    return {"vae": name, "size": size, "frames": frames, "seconds": round(time.perf_counter() - start, 1),
            "peak_mib": round(peak / MIB, 2), "factor": round(peak / level, 2), "params_m": round(params / 1e6, 1),
            "params_per_c2": round(params / sum(c * c for c in channels), 1),
            # the estimate's activations (less its weights and pixels) over the measured peak
            "activations_estimate_over_measured": round((estimate - weights - x.numel() * 4) / peak, 3)}


def distance(vae, x: torch.Tensor, settings: dict, track: bool = True) -> dict:
    vae_tiling.apply(vae, False, settings)
    untiled, peak_u = encode(vae, x, track)
    vae_tiling.apply(vae, True, settings)
    tiled, peak_t = encode(vae, x, track)
    vae_tiling.apply(vae, False, settings)
    u, t = untiled.double().flatten(), tiled.double().flatten()
    return {"rel_l2": round(((t - u).norm() / u.norm()).item(), 4),
            "cosine": round(torch.nn.functional.cosine_similarity(t, u, 0).item(), 5),
            "max_abs_over_std": round(((t - u).abs().max() / u.std()).item(), 3),
            "peak_untiled_mib": round(peak_u / MIB, 1), "peak_tiled_mib": round(peak_t / MIB, 1)}


def _tile_of(vae) -> str:
    side = getattr(vae, "tile_sample_min_size", None) or getattr(vae, "tile_sample_min_height")
    frames = getattr(vae, "tile_sample_min_num_frames", None)
    return f"{side}" + (f", {frames} frames" if frames and getattr(vae, "use_framewise_decoding", False) else "")


def quarter_row(name: str, width: int, height: int, frames: int, settings: dict | None = None) -> dict:
    cls, kwargs = real(name, width=4)
    vae = build(cls, kwargs)
    start = time.perf_counter()
    row = distance(vae, pixels(width, height, frames, _is_video(name)), settings or {})
    vae_tiling.apply(vae, True, settings or {})
    tile = _tile_of(vae)
    return {"vae": name, "weights": "random, 1/4 width", "size": f"{width}x{height}", "frames": frames,
            "tile": tile, **row, "seconds": round(time.perf_counter() - start, 1)}


def trained_rows() -> list[dict]:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(HERE.parent / "data" / "demo_base", subfolder="vae").eval()
    rows = []
    for size in (128, 192, 256):
        rows.append({"vae": "AutoencoderKL (demo_base)", "weights": "trained", "size": f"{size}x{size}", "frames": 0,
                     "tile": str(vae.tile_sample_min_size), **distance(vae, pixels(size, size, 0, False), {})})
    return rows


TINY = {  # family: (frames, test-sized tiles for 128 px images; diffusers' names)
    "flux": (0, {}),  # the tiny AutoencoderKL's own tile: sample_size 64
    "flux2_klein": (0, {}),
    "qwenimage": (1, {"tile_sample_min_height": 64, "tile_sample_min_width": 64,
                      "tile_sample_stride_height": 48, "tile_sample_stride_width": 48}),
    "wan": (17, {"tile_sample_min_height": 64, "tile_sample_min_width": 64,
                 "tile_sample_stride_height": 48, "tile_sample_stride_width": 48}),
    "ltx2": (17, {"tile_sample_min_height": 64, "tile_sample_min_width": 64,
                  "tile_sample_stride_height": 64, "tile_sample_stride_width": 64}),
    "hunyuan_video15": (9, {"tile_sample_min_height": 64, "tile_sample_min_width": 64,
                            "tile_latent_min_height": 4, "tile_latent_min_width": 4}),
}


def tiny_rows() -> list[dict]:
    import tasks.models as models

    rows = []
    for family, (frames, tiles) in TINY.items():
        out = Path(tempfile.mkdtemp(prefix="loraflow-bench-vae-")) / family
        models.build_tiny(family, out, 0, {})
        adapter = models.adapter_class(family)(out, "float32")
        vae = adapter.load_vae()
        settings = {**adapter.vae_tiling, **tiles}
        row = distance(vae, pixels(128, 128, frames, frames > 0), settings, track=False)
        vae_tiling.apply(vae, True, settings)
        rows.append({"vae": f"{type(vae).__name__} (tiny_{family})", "weights": "random, tiny", "size": "128x128",
                     "frames": frames, "tile": _tile_of(vae), **row})
    return rows


FACTORS = [("AutoencoderKL", 128, 0), ("AutoencoderKL", 256, 0), ("AutoencoderKLFlux2", 128, 0),
           ("AutoencoderKLFlux2", 256, 0), ("AutoencoderKLWan", 128, 1), ("AutoencoderKLWan", 64, 17),
           ("AutoencoderKLQwenImage", 128, 1), ("AutoencoderKLLTX2Video", 128, 1), ("AutoencoderKLLTX2Video", 64, 17),
           ("AutoencoderKLHunyuanVideo15", 128, 1), ("AutoencoderKLHunyuanVideo15", 64, 9)]
QUARTER = [("AutoencoderKL", 1280, 1280, 0), ("AutoencoderKL-sd15", 640, 640, 0),
           ("AutoencoderKLFlux2", 1280, 1280, 0), ("AutoencoderKLQwenImage", 512, 512, 1),
           ("AutoencoderKLWan", 512, 512, 1), ("AutoencoderKLWan", 320, 320, 17),
           ("AutoencoderKLLTX2Video", 1024, 1024, 1),
           ("AutoencoderKLLTX2Video", 128, 128, 33, {"use_framewise_encoding": True, "use_framewise_decoding": True}),
           ("AutoencoderKLHunyuanVideo15", 512, 512, 1), ("AutoencoderKLHunyuanVideo15", 320, 320, 9)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vae_tiling", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "vae_tiling.json"))
    ap.add_argument("--quick", action="store_true", help="the trained and tiny rows only (seconds)")
    args = ap.parse_args(argv)
    clock = time.perf_counter()
    factors = [] if args.quick else [factor_row(*f) for f in FACTORS]
    for r in factors:
        print(f"{r['vae']:28} {r['size']:4} px {r['frames']:3} fr  peak {r['peak_mib']:8.1f} MiB"
              f"  factor {r['factor']:5.2f}  params {r['params_m']:7.1f} M ({r['params_per_c2']}/c^2)"
              f"  estimate/measured {r['activations_estimate_over_measured']}",
              flush=True)
    rows = []
    for r in itertools.chain(trained_rows(), tiny_rows(), () if args.quick else (quarter_row(*q) for q in QUARTER)):
        rows.append(r)
        print(f"{r['vae']:40} {r['weights']:18} {r['size']:>9} {r['frames']:3} fr tile {r['tile']:>14}  "
              f"rel L2 {r['rel_l2']:.4f}  cos {r['cosine']:.5f}"
              f"  peak {r['peak_untiled_mib']} -> {r['peak_tiled_mib']} MiB",
              flush=True)
    from bench import common

    out = {"factors": factors, "distances": rows, "dtype": "float32", "date": datetime.now(timezone.utc).isoformat(
        timespec="seconds"), "machine": {**common.machine_info(), **{k: os.environ.get(k) for k in (
            "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}}, "versions": common.versions(),
        "total_seconds": round(time.perf_counter() - clock, 1)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
