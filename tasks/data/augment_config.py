"""Caption augmentation settings: the `CaptionAug` record and its reading from the `data` and `text` config
sections, with an error per bad value that names its key (see tasks/data/augment.py for what they do)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real


@dataclass(frozen=True)
class CaptionAug:
    caption_dropout_rate: float = 0.0
    shuffle_caption: bool = False
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    caption_tag_dropout_rate: float = 0.0
    token_warmup_step: float = 0      # 0 = off; < 1 = fraction of max_steps
    token_warmup_min: int = 1
    variants: int = 4                 # cached variants per caption (and per warm-up length) when shuffling/tag dropout
    max_steps: int = 1


# ----------------------------------------------------------------------------------------------- config

# (section, key, kind, default): kind "rate" = number in [0, 1], "count" = integer >= 0,
# "positive" = integer >= 1, "nonneg" = number >= 0, "bool", "str"
_KEYS = (
    ("data", "caption_dropout_rate", "rate", 0.0),
    ("data", "shuffle_caption", "bool", False),
    ("data", "keep_tokens", "count", 0),
    ("data", "keep_tokens_separator", "str", ""),
    ("data", "caption_tag_dropout_rate", "rate", 0.0),
    ("data", "token_warmup_step", "nonneg", 0),
    ("data", "token_warmup_min", "count", 1),
    ("text", "variants", "positive", 4),
)


def setting(cfg, key):
    """cfg[key] of a dict, DictConfig or object; None when it is missing."""
    if cfg is None:
        return None
    try:
        return cfg.get(key)
    except AttributeError:
        return getattr(cfg, key, None)


def _is_number(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(float(v))


def _is_int(v) -> bool:
    return _is_number(v) and float(v) == int(v)


def errors(data_cfg, text_cfg) -> list[str]:
    """Every bad caption-augmentation value, each naming its key and the valid range. Missing or null
    keys take their defaults and are fine."""
    out = []
    cfgs = {"data": data_cfg, "text": text_cfg}
    for section, key, kind, _ in _KEYS:
        v = setting(cfgs[section], key)
        if v is None:
            continue
        name = f"{section}.{key}={v!r}"
        if kind == "rate" and not (_is_number(v) and 0.0 <= float(v) <= 1.0):
            out.append(f"{name}: must be a number in [0, 1]")
        elif kind == "count" and not (_is_int(v) and int(v) >= 0):
            out.append(f"{name}: must be an integer >= 0")
        elif kind == "positive" and not (_is_int(v) and int(v) >= 1):
            out.append(f"{name}: must be an integer >= 1")
        elif kind == "nonneg" and not (_is_number(v) and float(v) >= 0.0):
            out.append(f"{name}: must be a number >= 0 (0 = off, below 1 = a fraction of train.max_steps, "
                       f"else a number of steps)")
        elif kind == "bool" and not isinstance(v, bool):
            out.append(f"{name}: must be true or false")
        elif kind == "str" and not isinstance(v, str):
            out.append(f"{name}: must be a string (empty = off)")
    return out


def from_config(data_cfg, text_cfg, max_steps: int) -> CaptionAug:
    """The CaptionAug of the data and text config sections (dicts or DictConfigs; missing keys take
    their defaults). Raises ValueError listing every bad value (see ``errors``)."""
    bad = errors(data_cfg, text_cfg)
    if bad:
        raise ValueError("bad caption augmentation config: " + "; ".join(bad))
    cfgs = {"data": data_cfg, "text": text_cfg}
    values = {}
    for section, key, kind, default in _KEYS:
        v = setting(cfgs[section], key)
        if v is None:
            v = default
        if kind == "rate":
            v = float(v)
        elif kind in ("count", "positive"):
            v = int(v)
        elif kind == "nonneg":
            v = int(v) if _is_int(v) else float(v)
        values[key] = v
    return CaptionAug(max_steps=int(max_steps), **values)
