"""The images the learning check is drawn on (issue 48): beside the demo image it was tuned on, generated ones of
kinds a tiny model may hold differently, each from a fixed seed at the check's size, with a short caption.

- shapes: a shape of the demo world in colours the demo image does not use (flat regions, sharp edges);
- checkers: a two-colour checkerboard of 8 px squares, randomly offset (a periodic high frequency);
- gradient: a smooth two-axis colour gradient with low-amplitude noise (no edge at all);
- pattern: black and white diagonal stripes of random width under a white disc (the issue's high-contrast case,
  with a one-word caption)."""
from __future__ import annotations

import numpy as np
from PIL import Image

NAMES = ("shapes", "checkers", "gradient", "pattern")


def generated(name: str, size: int) -> tuple[Image.Image, str]:
    """(image, caption) of the generated image `name`, size x size, the same bytes on every machine."""
    rng = np.random.default_rng({"shapes": 11, "checkers": 12, "gradient": 13, "pattern": 14}[name])
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) / size
    if name == "shapes":
        from tasks.demo import world

        caption = world.caption("triangle", "green", "yellow")
        return world.render(*world.parse(caption)).resize((size, size), Image.Resampling.BICUBIC), caption
    if name == "checkers":
        ox, oy = rng.integers(0, 8, 2)
        cells = ((np.arange(size)[None, :] + ox) // 8 + (np.arange(size)[:, None] + oy) // 8) % 2
        a = np.where(cells[..., None] == 1, [220, 30, 30], [245, 245, 245])
        return Image.fromarray(a.astype(np.uint8)), "a red and white checker pattern"
    if name == "gradient":
        a = np.stack([40 + 200 * x, 60 + 120 * y, 230 - 180 * x * y], axis=-1) + rng.normal(0, 2, (size, size, 3))
        return Image.fromarray(np.clip(a, 0, 255).round().astype(np.uint8)), "a smooth blue to orange gradient"
    if name == "pattern":
        width = rng.uniform(0.08, 0.14)
        stripes = (((x + y) / width).astype(int) % 2) * 255
        disc = (x - 0.5) ** 2 + (y - 0.5) ** 2 < 0.2 ** 2
        a = np.where(disc, 255, stripes)
        return Image.fromarray(np.repeat(a[..., None], 3, axis=-1).astype(np.uint8)), "stripes"
    raise ValueError(f"no generated image {name!r}: one of {', '.join(NAMES)}")
