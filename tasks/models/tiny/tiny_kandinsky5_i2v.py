"""A tiny, deterministic Kandinsky 5.0 image-to-video pipeline (`Kandinsky5I2VPipeline`, the
kandinskylab/Kandinsky-5.0-I2V-Pro-sft-5s-Diffusers layout) built offline from the real diffusers/transformers
classes, in the conventions of tiny_kandinsky5.py, whose components (seeds 0-3) it shares: the image-to-video
pipeline has the same components (the transformer with `visual_cond`, HunyuanVideo's VAE, Qwen2.5-VL and CLIP); it
differs in how it fills the first latent frame (tasks/models/kandinsky5_i2v.py)."""
from __future__ import annotations

from pathlib import Path

from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_kandinsky5 import K5_ARCH, k5_parts
from tasks.models.tiny.tiny_kandinsky5 import LEARNS as K5_LEARNS


def build_tiny_kandinsky5_i2v(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `Kandinsky5I2VPipeline` saved in diffusers layout under `out_dir` (keys of K5_ARCH)."""
    from diffusers import Kandinsky5I2VPipeline

    a = resolve_arch(K5_ARCH, arch)
    pipe = Kandinsky5I2VPipeline(**k5_parts(a, seeder(seed, 4)))
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the same clip from its first frame, rendered by Kandinsky5I2VPipeline (its 9 frames: the
# adapter's finite_first_frames). The text-to-video width, 300 steps at 3e-3: 0.075 for both files (a misnamed block
# 0.375, caught; a halved scale 0.158, under the bound); 434 s on 2 shared cores
LEARNS = {"tiny_kandinsky5_i2v": {**K5_LEARNS["tiny_kandinsky5"], "lr": 3e-3, "i2v": True}}
