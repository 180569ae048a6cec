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
