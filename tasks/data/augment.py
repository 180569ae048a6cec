"""Caption augmentation that works with a text-encoder cache.

sd-scripts (kohya-ss, library/train_util.py ``process_caption``) refuses to cache text-encoder outputs
when caption dropout, caption shuffling, token warm-up or tag dropout is on, because every step may
produce a new text. Here every text the training loop can ask for is either

* one of a finite, deterministic set that the cache node pre-encodes (``cached_texts``): per caption,
  one set of *variants* for the full caption and one per token-warm-up truncation length that training
  can reach; ``choose`` then picks a label per step (or None = caption dropped, use the empty prompt,
  which the pipeline caches once), or
* drawn fresh every step and encoded on demand (``fresh``).

Semantics follow sd-scripts' ``process_caption``:

1. caption dropout: with probability ``caption_dropout_rate`` the caption becomes "";
2. tags: the caption split on "," and stripped (empty tags are left out);
3. fixed tags: the first ``keep_tokens`` tags, or, where ``keep_tokens_separator`` (e.g. "|||") occurs in
   the caption, the tags before it (and, as in sd-scripts, the tags after a second separator form a fixed
   suffix); the separator itself is removed;
4. token warm-up: while the (0-based) step ``s < warmup_steps`` the flexible tags are truncated to
   ``floor(s * ((len(flex) - token_warmup_min) / warmup_steps)) + token_warmup_min``; a token_warmup_step
   below 1 is a fraction of max_steps (``floor(token_warmup_step * max_steps)``);
5. shuffle of the flexible tags, then tag dropout (each flexible tag dropped with probability
   ``caption_tag_dropout_rate``);
6. joined with ", ": fixed + flexible + fixed suffix.

Steps here are 1-based training steps (step 1 = the first optimizer step); sd-scripts' ``current_step``
is the 0-based global step, so the formula is evaluated at ``step - 1`` (the first step shows
``token_warmup_min`` tags, exactly as in sd-scripts).

Pure module: stdlib, hashlib and torch only. Cached variants are derived from hashlib digests of
(seed, caption, length, index), so they are identical across processes and machines (never Python's
salted ``hash()``).
"""
from __future__ import annotations

import hashlib
import math

from tasks.data.augment_config import CaptionAug, errors, from_config, setting  # the settings, read from the config
from tasks.lazy import lazy

torch = lazy("torch")

__all__ = ["CaptionAug", "from_config", "errors", "active", "randomizes", "warmup_steps", "split_tags",
           "split_parts", "warmup_lengths", "length_at", "label", "variant", "canonical", "cached_texts",
           "choose", "fresh", "describe", "MODES"]

MODES = ("cached", "fresh", "live")

# ------------------------------------------------------------------------------------------ predicates

def warmup_steps(aug: CaptionAug) -> int:
    """The token warm-up length in steps (0 = off); a token_warmup_step below 1 is a fraction of
    max_steps, floored as in sd-scripts."""
    w = aug.token_warmup_step
    if not w or w <= 0:
        return 0
    if w < 1:
        return max(math.floor(w * aug.max_steps), 0)
    return int(math.floor(w))


def randomizes(aug: CaptionAug) -> bool:
    """Shuffle or tag dropout on: several variants per caption (and per warm-up length) are needed."""
    return bool(aug.shuffle_caption) or aug.caption_tag_dropout_rate > 0


def active(aug: CaptionAug) -> bool:
    """Any augmentation on (caption dropout, shuffle, tag dropout or token warm-up)."""
    return aug.caption_dropout_rate > 0 or randomizes(aug) or warmup_steps(aug) > 0


# -------------------------------------------------------------------------------------------- the tags

def _tags(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _has_separator(caption: str, aug: CaptionAug) -> bool:
    return bool(aug.keep_tokens_separator) and aug.keep_tokens_separator in caption


def split_parts(caption: str, aug: CaptionAug) -> tuple[list[str], list[str], list[str]]:
    """(fixed, flex, fixed_suffix). With keep_tokens_separator in the caption: the tags before it are
    fixed, and (as in sd-scripts) the tags after a second separator are a fixed suffix; otherwise the
    first keep_tokens tags are fixed and the suffix is empty."""
    sep = aug.keep_tokens_separator
    if _has_separator(caption, aug):
        fixed_part, flex_part = caption.split(sep, 1)
        suffix: list[str] = []
        if sep in flex_part:
            flex_part, suffix_part = flex_part.split(sep, 1)
            suffix = _tags(suffix_part.replace(sep, ","))
        return _tags(fixed_part), _tags(flex_part), suffix
    tags = _tags(caption)
    k = max(int(aug.keep_tokens), 0)
    return tags[:k], tags[k:], []


def split_tags(caption: str, aug: CaptionAug) -> tuple[list[str], list[str]]:
    """(fixed, flex): the leading fixed tags and the tags that warm-up, shuffle and tag dropout act on.
    A fixed suffix (tags after a second separator) is in ``split_parts``."""
    fixed, flex, _ = split_parts(caption, aug)
    return fixed, flex


def _join(fixed, flex, suffix) -> str:
    return ", ".join(list(fixed) + list(flex) + list(suffix))


# ----------------------------------------------------------------------------------------- token warm-up

def _formula(s: int, n: int, mn: int, w: int) -> int:
    # exactly sd-scripts' expression (same float evaluation order, so the same floor at boundaries)
    return math.floor(s * ((n - mn) / w)) + mn


def _length(n: int, aug: CaptionAug, step: int) -> int | None:
    w = warmup_steps(aug)
    s = max(int(step) - 1, 0)
    if w <= 0 or s >= w:
        return None
    length = _formula(s, n, int(aug.token_warmup_min), w)
    if length >= n:
        return None
    return max(length, 0)


def length_at(caption: str, aug: CaptionAug, step: int) -> int | None:
    """The number of flexible tags at this 1-based training step (None = all of them)."""
    return _length(len(split_parts(caption, aug)[1]), aug, step)


def warmup_lengths(caption: str, aug: CaptionAug) -> list[int | None]:
    """The distinct flexible-tag counts training can use for this caption: None (all tags) first, then
    every truncation length below len(flex) that some step before the warm-up ends reaches, ascending.
    O(len(flex)), not O(warm-up steps)."""
    out: list[int | None] = [None]
    w = warmup_steps(aug)
    n = len(split_parts(caption, aug)[1])
    mn = int(aug.token_warmup_min)
    if w <= 0 or n <= 0:
        return out
    if mn >= n:
        # every step before the end gives >= n tags (see sd-scripts' formula), i.e. the full caption
        return out
    r = (n - mn) / w
    found = []
    for k in range(0, n - mn):  # target floor(s * r) == k, i.e. length k + mn < n
        s0 = math.ceil(k / r)
        for s in (s0 - 1, s0, s0 + 1):
            if 0 <= s < w and _formula(s, n, mn, w) == k + mn:
                found.append(k + mn)
                break
    # a negative token_warmup_min is rejected by errors(); lengths are >= 0 here
    return out + sorted(set(max(x, 0) for x in found))


# ------------------------------------------------------------------------------------- cached variants

def _unit(*parts) -> float:
    """A uniform number in [0, 1) from a stable digest of parts."""
    h = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode("utf-8"), digest_size=8,
                        person=b"loraflow-aug")
    return int.from_bytes(h.digest(), "big") / 2.0 ** 64


def label(length: int | None, index: int) -> str:
    """The cached_texts label of a warm-up length and a variant index: "full.v0", "len3.v2"."""
    return f"{'full' if length is None else f'len{int(length)}'}.v{int(index)}"


def canonical(caption: str, aug: CaptionAug) -> str:
    """The caption with nothing random done to it: the caption itself, except that a
    keep_tokens_separator in it is removed (tags re-joined with ", ")."""
    if not _has_separator(caption, aug):
        return caption
    return _join(*split_parts(caption, aug))


def variant(caption: str, aug: CaptionAug, length: int | None, index: int, seed: int) -> str:
    """The cached text number ``index`` of this caption at this flexible-tag length (None = all tags):
    flex tags truncated to ``length``, shuffled if shuffle_caption, tag-dropped if
    caption_tag_dropout_rate > 0. Deterministic in (seed, caption, length, index) via hashlib. Without
    shuffle and tag dropout every index gives the (truncated) caption; at full length that is the
    caption itself (``canonical``)."""
    fixed, flex, suffix = split_parts(caption, aug)
    if length is not None and length >= len(flex):
        length = None
    if length is None and not randomizes(aug):
        return canonical(caption, aug)
    if length is not None:
        flex = flex[:max(int(length), 0)]
    key = (seed, caption, "full" if length is None else int(length), int(index))
    if aug.shuffle_caption:
        order = sorted(range(len(flex)), key=lambda i: (_unit("shuffle", *key, i), i))
        flex = [flex[i] for i in order]
    p = aug.caption_tag_dropout_rate
    if p > 0:
        flex = [t for j, t in enumerate(flex) if _unit("tagdrop", *key, j) >= p]
    return _join(fixed, flex, suffix)


def _n_variants(aug: CaptionAug) -> int:
    return max(int(aug.variants), 1) if randomizes(aug) else 1


def cached_texts(caption: str, aug: CaptionAug, seed: int) -> dict[str, str]:
    """Every text the cached path can use for this caption, label -> text (labels "full.vK", "lenL.vK"):
    per warm-up length, aug.variants variants if shuffle/tag dropout is on, else one. Different labels
    may share a text (dedupe by text when encoding). The empty caption for caption dropout is not here:
    the pipeline caches "" once."""
    if not randomizes(aug) and warmup_steps(aug) <= 0:  # one text, what the general path gives (100,000 captions)
        return {label(None, 0): canonical(caption, aug)}
    n = _n_variants(aug)
    return {label(length, i): variant(caption, aug, length, i, seed)
            for length in warmup_lengths(caption, aug) for i in range(n)}


# ----------------------------------------------------------------------------------------- per step

def _device(generator: torch.Generator):
    return generator.device


def choose(caption: str, aug: CaptionAug, step: int, generator: torch.Generator) -> str | None:
    """The cached_texts label to train on at this 1-based step, or None = caption dropped (use the
    empty prompt). With any augmentation on it draws exactly one torch.rand (dropout) and one
    torch.randint (variant) from ``generator`` whatever the outcome, so the rest of the generator's
    stream (e.g. the training noise) does not depend on augmentation outcomes; with none on it draws
    nothing and returns "full.v0"."""
    if not active(aug):
        return "full.v0"
    dev = _device(generator)
    u = float(torch.rand(1, generator=generator, device=dev, dtype=torch.float64).item())
    k = int(torch.randint(0, _n_variants(aug), (1,), generator=generator, device=dev).item())
    if aug.caption_dropout_rate > 0 and u < aug.caption_dropout_rate:
        return None
    return label(length_at(caption, aug, step), k)


def fresh(caption: str, aug: CaptionAug, step: int, generator: torch.Generator) -> str:
    """A fresh draw at this 1-based step (on-demand encoding): caption dropout -> "", warm-up
    truncation, shuffle by torch.randperm, tag dropout by torch.rand, all from ``generator``.
    Deterministic given the generator state; what it draws depends on the caption and step only, never
    on outcomes (the shuffle and tag-dropout draws are made even when the caption is dropped). With no
    augmentation on it draws nothing and returns ``canonical(caption)``."""
    if not active(aug):
        return canonical(caption, aug)
    dev = _device(generator)
    u = float(torch.rand(1, generator=generator, device=dev, dtype=torch.float64).item())
    fixed, flex, suffix = split_parts(caption, aug)
    length = _length(len(flex), aug, step)
    if length is not None:
        flex = flex[:length]
    if aug.shuffle_caption:
        perm = torch.randperm(len(flex), generator=generator, device=dev).tolist()
        flex = [flex[i] for i in perm]
    p = aug.caption_tag_dropout_rate
    if p > 0:
        r = torch.rand(len(flex), generator=generator, device=dev, dtype=torch.float64).tolist()
        flex = [t for t, x in zip(flex, r) if x >= p]
    if aug.caption_dropout_rate > 0 and u < aug.caption_dropout_rate:
        return ""
    if length is None and not randomizes(aug):
        return canonical(caption, aug)
    return _join(fixed, flex, suffix)


# ------------------------------------------------------------------------------------------- logging

def _rate(x: float) -> str:
    return f"{x:g}"


def _what(aug: CaptionAug) -> str:
    parts = []
    if aug.caption_dropout_rate > 0:
        parts.append(f"caption dropout {_rate(aug.caption_dropout_rate)}")
    if aug.shuffle_caption:
        parts.append("shuffle")
    if aug.caption_tag_dropout_rate > 0:
        parts.append(f"tag dropout {_rate(aug.caption_tag_dropout_rate)}")
    w = warmup_steps(aug)
    if w > 0:
        parts.append(f"token warm-up from {aug.token_warmup_min} tags over {w} steps")
    text = " + ".join(parts)
    if randomizes(aug) or w > 0:
        if aug.keep_tokens_separator:
            text += f" (tags before {aug.keep_tokens_separator!r} fixed"
            text += f", else the first {aug.keep_tokens})" if aug.keep_tokens else ")"
        elif aug.keep_tokens:
            text += f" (first {aug.keep_tokens} tags fixed)"
    return text


def text_mode(text_cfg, aug: CaptionAug) -> str:
    """How captions meet the text encoders: "live" (text.cache=false), "fresh" (text.fresh_draws=true with
    shuffle/tag dropout: a new draw every step, encoded on demand), else "cached" (pre-encoded variants)."""
    if not setting(text_cfg, "cache"):
        return "live"
    return "fresh" if setting(text_cfg, "fresh_draws") and randomizes(aug) else "cached"


def describe(aug: CaptionAug, mode: str) -> str:
    """One log line saying what caption augmentation does and how it meets the text encoders.
    mode: "cached" (pre-encoded variants from the text cache), "fresh" (a new draw every step, encoded
    on demand with the encoders loaded), "live" (no text cache: captions encoded live every step)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {', '.join(MODES)}")
    if not active(aug):
        return "caption augmentation: off"
    what = _what(aug)
    w = warmup_steps(aug)
    if mode == "cached":
        if randomizes(aug):
            per = "per caption" + (" and per warm-up length" if w > 0 else "")
            how = (f"with the text cache: {aug.variants} cached variants {per} drawn per step "
                   f"(text.variants={aug.variants}; text.fresh_draws=true encodes a new draw every step "
                   f"with the encoders loaded)")
        else:
            texts = []
            if w > 0:
                texts.append("one text per warm-up length")
            if aug.caption_dropout_rate > 0:
                texts.append("the empty caption")
            how = "with the text cache: every text it can produce is pre-encoded (" + " and ".join(texts) + ")"
        return f"caption augmentation: {what} {how}"
    if mode == "fresh":
        return (f"caption augmentation: {what}, a fresh draw every step encoded on demand "
                f"(text.fresh_draws=true: the text encoders stay loaded)")
    return f"caption augmentation: {what}, a fresh draw every step (text.cache=false: captions encoded live)"
