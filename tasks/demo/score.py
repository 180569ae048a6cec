"""Does an image show what its caption says? A deterministic check built from the world (world.py).

background = nearest palette colour to the median of the border pixels;
foreground mask = pixels far from that colour; its colour = nearest palette colour to their median;
shape = the world template (base shapes and the concept) of best IoU with the mask, centroids aligned.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from tasks.demo import world
from tasks.demo.world import parse  # noqa: F401  (part of this module's API: caption -> (shape, colour, background))

_NAMES = list(world.PALETTE)
_RGB = np.array([world.PALETTE[n] for n in _NAMES], np.float32)
_SHAPES = (*world.SHAPES, world.CONCEPT)
_TEMPLATES = {s: world.template(s) for s in _SHAPES}
BORDER = 4  # pixels: the shapes keep at least 10 away from the edge
FAR = 128.0  # RGB distance from the background colour that makes a pixel foreground (palette colours: >= 255 apart)
MIN_IOU = 0.5  # the best template must overlap the mask at least this well (templates overlap each other <= ~0.64)


def _nearest(rgb: np.ndarray) -> str:
    return _NAMES[int(np.argmin(((_RGB - rgb) ** 2).sum(-1)))]


def _aligned(mask: np.ndarray, target: np.ndarray) -> np.ndarray:
    """mask shifted (whole pixels) so its centroid is the target's: a slightly off-centre shape still matches."""
    (my, mx), (ty, tx) = np.argwhere(mask).mean(0), np.argwhere(target).mean(0)
    return np.roll(mask, (int(round(ty - my)), int(round(tx - mx))), (0, 1))


def read(image: Image.Image) -> tuple[str | None, str | None, str]:
    """What the image shows: (shape or None, colour or None, background)."""
    a = np.asarray(image.convert("RGB").resize((world.SIZE, world.SIZE), Image.BILINEAR), np.float32)
    edge = np.ones(a.shape[:2], bool)
    edge[BORDER:-BORDER, BORDER:-BORDER] = False
    background = _nearest(np.median(a[edge], axis=0))
    mask = np.sqrt(((a - world.PALETTE[background]) ** 2).sum(-1)) > FAR
    if mask.sum() < 50:  # nothing there
        return None, None, background
    colour = _nearest(np.median(a[mask], axis=0))
    ious = {}
    for s, t in _TEMPLATES.items():
        m = _aligned(mask, t)
        ious[s] = (m & t).sum() / (m | t).sum()
    shape = max(ious, key=ious.get)
    return (shape if ious[shape] >= MIN_IOU else None), colour, background


def shows(image: Image.Image, caption: str) -> bool:
    """True when the image shows the caption's shape, in its colour, on its background."""
    return read(image) == parse(caption)


def share(images, captions) -> float:
    """The fraction of images that show their caption, in [0, 1]."""
    images, captions = list(images), list(captions)
    if len(images) != len(captions) or not images:
        raise ValueError("need as many images as captions, at least one")
    return sum(shows(i, c) for i, c in zip(images, captions)) / len(images)
