"""Image sizes: pixels or area (megapixels), snapped to a model family's multiple (VAE factor x patch)."""
from __future__ import annotations

import math

from tasks.config import ConfigError

MEGAPIXEL = 1024 * 1024  # "1.0" area = 1024x1024, as SimpleTuner and kohya count it


def snap(value: float, multiple: int) -> int:
    """Nearest multiple (at least one multiple)."""
    return max(multiple, round(value / multiple) * multiple)


def area_size(megapixels: float, aspect: float, multiple: int) -> tuple[int, int]:
    """(width, height) covering about `megapixels`, with width/height ~ aspect, both multiples of `multiple`.

    1.0 MP at 1:1 -> 1024x1024; at 3:2 -> 1248x832 (multiple 16)."""
    width = math.sqrt(megapixels * MEGAPIXEL * aspect)
    return snap(width, multiple), snap(width / aspect, multiple)


def resolve_size(resolution: float, resolution_type: str, multiple: int, aspect: float = 1.0) -> tuple[int, int]:
    """The training size from data.resolution: a side in pixels, or an area in megapixels."""
    if resolution_type == "area":
        return area_size(resolution, aspect, multiple)
    side = int(resolution)
    if side != resolution or side % multiple:
        lo, hi = max(multiple, side // multiple * multiple), (side // multiple + 1) * multiple
        raise ConfigError(f"data.resolution={resolution:g} must be a whole multiple of {multiple} for this model "
                          f"family; use data.resolution={lo} or data.resolution={hi}")
    return side, side


def bucket_sizes(width: int, height: int, multiple: int, max_aspect: float = 2.0) -> list[tuple[int, int]]:
    """Aspect-ratio buckets of at most the area of width x height, as kohya makes them: for each width in
    steps of `multiple`, the largest height (a multiple) that keeps the area, and the transposed bucket;
    aspects within 1/max_aspect..max_aspect."""
    area, out = width * height, set()
    w = multiple
    while w * w <= area * max_aspect:
        h = max(multiple, int(area // w) // multiple * multiple)
        if 1 / max_aspect <= w / h <= max_aspect:
            out |= {(w, h), (h, w)}
        w += multiple
    return sorted(out)


def nearest_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect is closest to the image's (in log space, so 2:1 and 1:2 are as far from 1:1)."""
    aspect = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - aspect), abs(b[0] * b[1] - width * height)))
