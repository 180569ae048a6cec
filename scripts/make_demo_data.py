"""Write the tiny, deterministic demo dataset used by the examples and tests.

Usage: python scripts/make_demo_data.py [out_dir]      (default: data/demo)

Writes img_00.png ... img_11.png (96x96 RGB procedural scenes) with same-stem
.txt captions into out_dir, plus a kohya-syntax sample-prompts file next to it
named <out_dir name>_prompts.txt (data/demo -> data/demo_prompts.txt).

Determinism: the scene list is fixed, positions/noise come from a seeded numpy
RNG, and PNGs are saved with fixed parameters (Pillow writes no timestamps), so
two runs give byte-identical files with the same Pillow/zlib build.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE = 96
SEED = 20240607
NOISE_STD = 6.0  # slight sensor-like noise so images are not perfectly flat

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 210),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 180),
    "orange": (240, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}

# (shape, shape colour, background kind, background colour or None).
# Fixed list rather than random choices so captions are stable and readable.
SCENES = [
    ("circle", "red", "solid", "blue"),
    ("square", "green", "solid", "yellow"),
    ("triangle", "blue", "striped", None),
    ("circle", "yellow", "gradient", None),
    ("square", "purple", "solid", "white"),
    ("triangle", "orange", "solid", "black"),
    ("circle", "white", "striped", None),
    ("square", "red", "gradient", None),
    ("triangle", "green", "solid", "purple"),
    ("circle", "black", "solid", "orange"),
    ("square", "blue", "striped", None),
    ("triangle", "yellow", "gradient", None),
]

PROMPTS = """\
# loraflow demo sample prompts, kohya syntax: --n negative, --w/--h size, --s steps, --l guidance, --d seed.
# Options left out take the sample.* defaults (sample.steps, sample.cfg, sample.seed), so those overrides apply.
# Example with every option: a red circle --n blurry --w 64 --h 64 --s 8 --l 3.5 --d 42
a red circle on a blue background
a green square on a yellow background --n blurry
a blue triangle on a striped background --w 64 --h 64
"""


def _background(kind: str, colour: str | None, rng: np.random.Generator) -> np.ndarray:
    """Return an HxWx3 float array for the requested background."""
    if kind == "solid":
        return np.broadcast_to(np.array(COLOURS[colour], np.float64), (SIZE, SIZE, 3)).copy()
    # Two random-but-seeded colours for gradient/stripes.
    c0 = rng.integers(0, 256, 3).astype(np.float64)
    c1 = rng.integers(0, 256, 3).astype(np.float64)
    if kind == "gradient":
        t = np.linspace(0.0, 1.0, SIZE)[None, :, None]  # left-to-right
        return np.broadcast_to(c0 * (1 - t) + c1 * t, (SIZE, SIZE, 3)).copy()
    if kind == "striped":
        period = int(rng.integers(8, 17))
        rows = (np.arange(SIZE) // (period // 2)) % 2  # horizontal stripes
        return np.where(rows[:, None, None] == 0, c0, c1) * np.ones((SIZE, SIZE, 3))
    raise ValueError(f"unknown background kind {kind!r}")


def _draw_shape(img: Image.Image, shape: str, colour: str, rng: np.random.Generator) -> None:
    half = int(rng.integers(18, 30))
    cx = int(rng.integers(half + 4, SIZE - half - 4))
    cy = int(rng.integers(half + 4, SIZE - half - 4))
    fill = COLOURS[colour]
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse((cx - half, cy - half, cx + half, cy + half), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - half, cy - half, cx + half, cy + half), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def caption_for(shape: str, colour: str, kind: str, bg_colour: str | None) -> str:
    bg = bg_colour if kind == "solid" else kind
    return f"{_a(colour)} {colour} {shape} on {_a(bg)} {bg} background"


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def make_image(index: int, rng: np.random.Generator) -> tuple[Image.Image, str]:
    shape, colour, kind, bg_colour = SCENES[index]
    bg = _background(kind, bg_colour, rng)
    img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8), "RGB")
    _draw_shape(img, shape, colour, rng)
    noisy = np.asarray(img, np.float64) + rng.normal(0.0, NOISE_STD, (SIZE, SIZE, 3))
    img = Image.fromarray(np.clip(np.rint(noisy), 0, 255).astype(np.uint8), "RGB")
    return img, caption_for(shape, colour, kind, bg_colour)


def write_demo(out_dir: Path) -> Path:
    """Write images, captions and the sibling prompts file; return the prompts path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)  # one stream, consumed in a fixed order
    for i in range(len(SCENES)):
        img, caption = make_image(i, rng)
        # Fixed PNG parameters; no pnginfo/exif so nothing time-dependent is stored.
        img.save(out_dir / f"img_{i:02d}.png", format="PNG", optimize=False, compress_level=9)
        (out_dir / f"img_{i:02d}.txt").write_bytes((caption + "\n").encode("utf-8"))
    prompts = out_dir.parent / f"{out_dir.name}_prompts.txt"
    prompts.write_bytes(PROMPTS.encode("utf-8"))
    return prompts


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if len(argv) > 1:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[0]) if argv else Path("data/demo")
    prompts = write_demo(out_dir)
    print(f"wrote {len(SCENES)} images + captions to {out_dir} and prompts to {prompts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
