"""A generated world of coloured shapes, for a demo where a LoRA visibly learns something.

Every image is 64x64 RGB: one shape, centred, at a fixed size, on a solid background, captioned
"a red circle on a blue background". The base model is pretrained on every (shape, colour, background)
combination of SHAPES; CONCEPT is a new shape (a plus sign) under a made-up word the base never sees,
which the demo LoRA then teaches.

Pure numpy/PIL and deterministic: the same call gives the same bytes on any machine.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from PIL import Image

SIZE = 64
# The corners of the RGB cube: every pair is at least 255 apart, so a colour survives a VAE round trip
# and an imperfect sample, and "nearest palette colour" is never a close call.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
    "cyan": (0, 255, 255), "magenta": (255, 0, 255), "white": (255, 255, 255), "black": (0, 0, 0),
}
SHAPES = ("circle", "square", "triangle")  # what the base model learns
CONCEPT = "zkx"  # a made-up word for a shape the base never sees: a plus sign
CAPTION = "a {colour} {shape} on a {background} background"
_CAPTION_RE = re.compile(r"^a (\w+) (\w+) on a (\w+) background$")
_SUPERSAMPLE = 4  # coverage from a 4x4 grid per pixel: smooth, deterministic edges


def _coverage(shape: str) -> np.ndarray:
    """(SIZE, SIZE) float32 in [0, 1]: how much of each pixel the shape covers. Sizes are picked so the
    shapes overlap little (IoU between any two templates stays under ~0.65)."""
    n = SIZE * _SUPERSAMPLE
    c = (np.arange(n) + 0.5) / _SUPERSAMPLE - SIZE / 2  # sub-pixel centres, origin at the image centre
    x, y = np.meshgrid(c, c)
    if shape == "circle":
        inside = x**2 + y**2 <= 18.0**2
    elif shape == "square":
        inside = (abs(x) <= 20) & (abs(y) <= 20)
    elif shape == "triangle":  # pointing up, base 44, height 40
        inside = (y >= -20) & (y <= 20) & (abs(x) <= 22 * (y + 20) / 40)
    elif shape == CONCEPT:  # a plus sign: two 14-wide bars, 44 long
        inside = ((abs(x) <= 7) & (abs(y) <= 22)) | ((abs(y) <= 7) & (abs(x) <= 22))
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return inside.reshape(SIZE, _SUPERSAMPLE, SIZE, _SUPERSAMPLE).mean(axis=(1, 3)).astype(np.float32)


def template(shape: str) -> np.ndarray:
    """The shape's binary mask (SIZE, SIZE): pixels at least half covered."""
    return _coverage(shape) >= 0.5


def render(shape: str, colour: str, background: str) -> Image.Image:
    """The world's image of `caption(shape, colour, background)`."""
    if colour == background:
        raise ValueError("the shape and background colours must differ")
    a = _coverage(shape)[..., None]
    fg, bg = np.array(PALETTE[colour], np.float32), np.array(PALETTE[background], np.float32)
    return Image.fromarray(np.rint(a * fg + (1 - a) * bg).astype(np.uint8), "RGB")


def caption(shape: str, colour: str, background: str) -> str:
    return CAPTION.format(shape=shape, colour=colour, background=background)


def parse(text: str) -> tuple[str, str, str]:
    """caption -> (shape, colour, background); ValueError if it is not a world caption."""
    m = _CAPTION_RE.match(text.strip())
    if not m or m[1] not in PALETTE or m[3] not in PALETTE or m[2] not in (*SHAPES, CONCEPT):
        raise ValueError(f"not a world caption: {text!r}")
    return m[2], m[1], m[3]


def _captions(shapes) -> list[str]:
    return [caption(s, c, b) for s in shapes for c in PALETTE for b in PALETTE if b != c]


def base_captions() -> list[str]:
    """Every base-world caption (3 shapes x 8 colours x 7 backgrounds = 168), in a fixed order."""
    return _captions(SHAPES)


def concept_captions() -> list[str]:
    """Every caption of the new concept (8 colours x 7 backgrounds = 56), in a fixed order."""
    return _captions([CONCEPT])


def concept_train_captions(n: int = 28) -> list[str]:
    """The n concept captions of the LoRA dataset: colour i on colour i+1, then on colour i+4 (palette order),
    so every colour appears as shape and as background, and most of the 56 pairs stay out (held-out pairs
    show whether the LoRA generalises)."""
    names = list(PALETTE)
    return [caption(CONCEPT, names[i % 8], names[(i % 8 + 1 + 3 * (i // 8)) % 8]) for i in range(n)]


def regularisation_captions(n: int = 14) -> list[str]:
    """n base captions (every 12th, from the 6th): prior-preservation images for the concept's LoRA dataset."""
    return base_captions()[5::12][:n]


def write_concept_dataset(out_dir: str | Path, n: int = 28, n_base: int = 14) -> Path:
    """Write the concept's LoRA dataset into out_dir (kohya convention: img_00.png + img_00.txt, ...): n concept
    images, plus n_base base-world images (base_00.png ...) so the LoRA keeps the base shapes (prior
    preservation; with concept images only, 14 of them, the LoRA turned most base circles into plus signs)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    items = [(f"img_{i:02d}", c) for i, c in enumerate(concept_train_captions(n))]
    items += [(f"base_{i:02d}", c) for i, c in enumerate(regularisation_captions(n_base))]
    for stem, text in items:
        render(*parse(text)).save(out_dir / f"{stem}.png", optimize=False, compress_level=9)
        (out_dir / f"{stem}.txt").write_text(text + "\n")
    return out_dir


if __name__ == "__main__":  # python -m tasks.demo.world [out_dir]: the concept dataset (default data/demo_concept)
    import sys

    print(write_concept_dataset(sys.argv[1] if len(sys.argv) > 1 else "data/demo_concept"))
