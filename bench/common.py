"""Shared pieces of the CPU benchmark: the mid-sized Flux config, generated datasets, timing helpers.

Nothing here imports Prefect: `bench.run` sets Prefect's environment (a temporary PREFECT_HOME, no API URL)
before anything imports it."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# A mid-sized Flux: the same builder as `model=tiny_flux` (tasks/models/tiny/tiny_flux.py:build_tiny_flux), wider and
# deeper, so that compute dominates each item and step (the 70k-parameter demo model is all overhead).
#   transformer: 2 double + 2 single blocks, 4 heads x 64 = 256 wide, 16 latent channels  (~7.5 M params)
#   VAE encoder: channels 64-128-128-128 (~1.9 M params, ~0.2 s per 256 px image on 2 cores)
#   CLIP-L-like: 4 layers x 256; T5-like: 8 layers x 512 (d_ff 2048), 128 tokens
MID_ARCH = {
    "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 64, "num_attention_heads": 4,
    "axes_dims_rope": [16, 24, 24],
    "latent_channels": 16, "vae_block_out_channels": [64, 128, 128, 128], "vae_layers_per_block": 1,
    "vae_norm_num_groups": 32,
    "clip_hidden_size": 256, "clip_layers": 4, "clip_heads": 4, "clip_intermediate_size": 1024,
    "t5_d_model": 512, "t5_d_kv": 64, "t5_d_ff": 2048, "t5_layers": 8, "t5_heads": 8, "t5_max_length": 128,
}
MID_SEQ = 128  # model.max_sequence_length (T5 tokens)
MID_RES = 256  # training size in pixels -> 32x32 latents -> 256 packed image tokens

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210), "yellow": (235, 210, 40),
           "purple": (140, 60, 180), "orange": (240, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")


def make_dataset(folder: Path, n: int, size: int, seed: int = 0) -> list[Path]:
    """n distinct PNG images (a shape on a noisy background) with same-stem, distinct .txt captions."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    paths = []
    for i in range(n):
        fg, bg = rng.choice(len(names), 2, replace=False)
        shape = SHAPES[i % len(SHAPES)]
        base = np.array(COLOURS[names[bg]], dtype=np.float32)
        pixels = np.clip(base + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
        img = Image.fromarray(pixels, "RGB")
        draw = ImageDraw.Draw(img)
        r = int(size * rng.uniform(0.15, 0.35))
        cx, cy = (int(v) for v in rng.integers(r, size - r, 2))
        box = (cx - r, cy - r, cx + r, cy + r)
        colour = COLOURS[names[fg]]
        if shape == "circle":
            draw.ellipse(box, fill=colour)
        elif shape == "square":
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
        path = folder / f"img_{i:04d}.png"
        img.save(path)
        caption = f"a photo of a {names[fg]} {shape} on a {names[bg]} background, picture number {i}"
        path.with_suffix(".txt").write_text(caption + "\n")
        paths.append(path)
    return paths


def write_prompts(path: Path, n: int, negative_every: int = 3) -> Path:
    lines = []
    for i in range(n):
        line = f"a {list(COLOURS)[i % len(COLOURS)]} {SHAPES[i % len(SHAPES)]} on a plain background, prompt {i}"
        if negative_every and i % negative_every == 1:
            line += " --n blurry, low quality"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    return path


def median(xs) -> float:
    return float(statistics.median(xs))


def alternate(fns: dict, reps: int, warmup: int = 1) -> dict[str, list]:
    """Call each of fns (name -> callable returning a measurement) `reps` times, alternating which goes first
    each round, after `warmup` unrecorded rounds. Returns name -> list of measurements."""
    names = list(fns)
    out = {n: [] for n in names}
    for r in range(warmup + reps):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            value = fns[n]()
            if r >= warmup:
                out[n].append(value)
    return out


class Clock:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


def machine_info() -> dict:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "diffusers", "transformers", "peft", "prefect", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out
