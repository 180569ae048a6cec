"""Caption augmentation (tasks/data/augment.py): sd-scripts semantics, deterministic cached variants, and a
per-step choice that draws a fixed number of numbers from the training generator."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tasks.data import augment as A
from tasks.data.augment import CaptionAug

CAP = "sks dog, red collar, grass, sunny day, park, tree, ball"  # 7 tags


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def tags(text):
    return [t.strip() for t in text.split(",") if t.strip()]


# ------------------------------------------------------------------------------------------ splitting

def test_split_tags_keep_tokens():
    assert A.split_tags(CAP, CaptionAug()) == ([], tags(CAP))
    fixed, flex = A.split_tags(" sks dog ,red collar,  grass ", CaptionAug(keep_tokens=1))
    assert fixed == ["sks dog"] and flex == ["red collar", "grass"]
    assert A.split_tags("a, b", CaptionAug(keep_tokens=5)) == (["a", "b"], [])


def test_split_tags_separator():
    aug = CaptionAug(keep_tokens=3, keep_tokens_separator="|||")
    assert A.split_tags("sks, dog ||| grass, park, tree", aug) == (["sks", "dog"], ["grass", "park", "tree"])
    # separator absent: keep_tokens applies
    assert A.split_tags("a, b, c, d", aug) == (["a", "b", "c"], ["d"])
    # a second separator starts a fixed suffix (sd-scripts)
    assert A.split_parts("a ||| b, c ||| d, e", aug) == (["a"], ["b", "c"], ["d", "e"])
    # the separator never reaches the text encoder
    assert A.canonical("sks, dog ||| grass, park", aug) == "sks, dog, grass, park"
    assert A.canonical(CAP, aug) == CAP
    v = A.variant("sks ||| a, b, c ||| tail", CaptionAug(shuffle_caption=True, keep_tokens_separator="|||"),
                  None, 2, 0)
    assert "|||" not in v and tags(v)[0] == "sks" and tags(v)[-1] == "tail"


# ------------------------------------------------------------------------------------------ warm-up

def sd_scripts_len(current_step, n, mn, w):
    """sd-scripts' process_caption: current_step is the 0-based global step."""
    if w and current_step < w:
        return len(list(range(n))[: math.floor(current_step * ((n - mn) / w)) + mn])
    return n


def test_warmup_steps():
    assert A.warmup_steps(CaptionAug()) == 0
    assert A.warmup_steps(CaptionAug(token_warmup_step=4)) == 4
    assert A.warmup_steps(CaptionAug(token_warmup_step=0.25, max_steps=100)) == 25
    assert A.warmup_steps(CaptionAug(token_warmup_step=0.3, max_steps=10)) == 3
    assert A.warmup_steps(CaptionAug(token_warmup_step=0.01, max_steps=10)) == 0  # floors to off


def test_length_at_formula():
    cap = "a, b, c, d, e"  # 5 flex tags, min 1, warm-up 4 steps
    aug = CaptionAug(token_warmup_step=4, token_warmup_min=1)
    assert [A.length_at(cap, aug, s) for s in range(1, 6)] == [1, 2, 3, 4, None]
    assert A.warmup_lengths(cap, aug) == [None, 1, 2, 3, 4]
    # the fixed tags do not count: keep_tokens=2 leaves 3 flex tags
    aug2 = CaptionAug(token_warmup_step=4, token_warmup_min=1, keep_tokens=2)
    assert [A.length_at(cap, aug2, s) for s in range(1, 6)] == [1, 1, 2, 2, None]
    assert A.warmup_lengths(cap, aug2) == [None, 1, 2]
    # matches sd-scripts (0-based current_step = step - 1) for long warm-ups
    for n, mn, w in [(7, 1, 10), (7, 3, 100), (12, 0, 7), (3, 1, 1000)]:
        aug = CaptionAug(token_warmup_step=w, token_warmup_min=mn)
        cap = ", ".join(f"t{i}" for i in range(n))
        for step in range(1, w + 3):
            want = sd_scripts_len(step - 1, n, mn, w)
            got = A.length_at(cap, aug, step)
            assert (n if got is None else got) == want, (n, mn, w, step)


def test_fractional_warmup():
    cap = "a, b, c, d, e"
    aug = CaptionAug(token_warmup_step=0.4, token_warmup_min=1, max_steps=10)  # 4 steps
    assert [A.length_at(cap, aug, s) for s in range(1, 7)] == [1, 2, 3, 4, None, None]
    assert A.warmup_lengths(cap, aug) == [None, 1, 2, 3, 4]


@pytest.mark.parametrize("n,mn,w", [(5, 1, 4), (7, 2, 3), (30, 1, 7), (6, 0, 1000), (4, 4, 9), (3, 6, 5),
                                    (10, 1, 10), (17, 3, 97), (1, 1, 2), (0, 1, 5)])
def test_warmup_lengths_are_exactly_the_reachable_ones(n, mn, w):
    cap = ", ".join(f"t{i}" for i in range(n))
    aug = CaptionAug(token_warmup_step=w, token_warmup_min=mn)
    reached = {A.length_at(cap, aug, s) for s in range(1, w + 5)}
    lengths = A.warmup_lengths(cap, aug)
    assert lengths[0] is None and set(lengths) == reached and len(lengths) == len(set(lengths))


# ---------------------------------------------------------------------------------------- variants

SHUF = CaptionAug(shuffle_caption=True, keep_tokens=1, variants=4)


def test_variant_deterministic_and_varied():
    v = [A.variant(CAP, SHUF, None, i, seed=7) for i in range(8)]
    assert v == [A.variant(CAP, SHUF, None, i, seed=7) for i in range(8)]
    assert len(set(v)) >= 6  # 720 orders of 6 flex tags
    for text in v:
        t = tags(text)
        assert t[0] == "sks dog" and sorted(t) == sorted(tags(CAP))
    # another seed changes the variants
    assert [A.variant(CAP, SHUF, None, i, seed=8) for i in range(8)] != v
    # truncated variants keep the fixed tag and the first `length` flex tags
    t = tags(A.variant(CAP, SHUF, 3, 0, seed=7))
    assert t[0] == "sks dog" and sorted(t[1:]) == sorted(tags(CAP)[1:4])


def test_variant_is_stable_across_processes():
    # hashlib, not the salted hash(): a fresh interpreter (other PYTHONHASHSEED) gives the same text
    code = ("from tasks.data.augment import CaptionAug, variant;"
            "print(variant('a, b, c, d, e, f', CaptionAug(shuffle_caption=True, caption_tag_dropout_rate=0.3),"
            " 2, 3, 11))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(s), "PATH": ""}, cwd=A.__file__.rsplit("/tasks/", 1)[0]
                           ).stdout.strip() for s in (1, 2)}
    here = A.variant("a, b, c, d, e, f", CaptionAug(shuffle_caption=True, caption_tag_dropout_rate=0.3), 2, 3, 11)
    assert outs == {here}


def test_variant_without_randomization_is_the_caption():
    aug = CaptionAug(caption_dropout_rate=0.5, token_warmup_step=3)
    assert A.variant(CAP, aug, None, 0, 0) == CAP
    assert A.variant(CAP, aug, 2, 0, 0) == "sks dog, red collar"
    assert A.variant(CAP, CaptionAug(), None, 0, 0) == CAP


def test_tag_dropout():
    aug = CaptionAug(caption_tag_dropout_rate=1.0, keep_tokens=2)
    for i in range(5):
        assert A.variant(CAP, aug, None, i, 3) == "sks dog, red collar"
    aug = CaptionAug(caption_tag_dropout_rate=0.5, keep_tokens=1, shuffle_caption=True)
    kept = [len(tags(A.variant(CAP, aug, None, i, 0))) - 1 for i in range(200)]
    assert all(t == "sks dog" for i in range(20) for t in tags(A.variant(CAP, aug, None, i, 0))[:1])
    assert 0.4 < sum(kept) / (6 * 200) < 0.6
    g = gen(1)
    for _ in range(20):
        assert A.fresh(CAP, CaptionAug(caption_tag_dropout_rate=1.0, keep_tokens=1), 1, g) == "sks dog"


# ------------------------------------------------------------------------------------ cached_texts

def test_cached_texts_counts():
    aug = CaptionAug(shuffle_caption=True, variants=3, token_warmup_step=4, token_warmup_min=1)
    cap = "a, b, c, d, e"
    texts = A.cached_texts(cap, aug, seed=0)
    assert sorted(texts) == sorted(f"{p}.v{i}" for p in ("full", "len1", "len2", "len3", "len4") for i in range(3))
    assert all(len(tags(texts[f"len{L}.v{i}"])) == L for L in (1, 2, 3, 4) for i in range(3))
    assert texts == A.cached_texts(cap, aug, seed=0)
    # no shuffle/tag dropout: one text per length
    aug = CaptionAug(token_warmup_step=4, token_warmup_min=1, caption_dropout_rate=0.2, variants=3)
    assert A.cached_texts(cap, aug, 0) == {"full.v0": cap, "len1.v0": "a", "len2.v0": "a, b", "len3.v0": "a, b, c",
                                           "len4.v0": "a, b, c, d"}
    assert A.cached_texts(cap, CaptionAug(), 0) == {"full.v0": cap}
    assert "" not in A.cached_texts(cap, CaptionAug(caption_dropout_rate=0.5), 0).values()


# ------------------------------------------------------------------------------------------ choose

def test_choose_returns_cached_labels():
    aug = CaptionAug(shuffle_caption=True, caption_tag_dropout_rate=0.1, caption_dropout_rate=0.2, variants=3,
                     token_warmup_step=6, token_warmup_min=2)
    keys = set(A.cached_texts(CAP, aug, 0))
    g = gen(0)
    seen = set()
    for step in range(1, 10):
        for _ in range(40):
            lab = A.choose(CAP, aug, step, g)
            assert lab is None or lab in keys
            seen.add(lab)
    assert None in seen and {"full.v0", "full.v1", "full.v2"} <= seen
    assert seen - {None} == keys  # every cached text is used at some step


def test_choose_dropout_one_always_none():
    g = gen(0)
    aug = CaptionAug(caption_dropout_rate=1.0, shuffle_caption=True)
    assert all(A.choose(CAP, aug, s, g) is None for s in range(1, 50))


def test_choose_draws_do_not_depend_on_outcome():
    base = dict(shuffle_caption=True, variants=4, token_warmup_step=5)
    g0, g1, g2 = gen(3), gen(3), gen(3)
    for step in range(1, 20):
        assert A.choose(CAP, CaptionAug(caption_dropout_rate=0.0, **base), step, g0) is not None
        assert A.choose(CAP, CaptionAug(caption_dropout_rate=1.0, **base), step, g1) is None
        A.choose("x", CaptionAug(caption_dropout_rate=0.5, caption_tag_dropout_rate=0.2, variants=1), step, g2)
        assert torch.equal(g0.get_state(), g1.get_state())
        assert torch.equal(g0.get_state(), g2.get_state())
    # the training noise after the choices is the same stream
    assert torch.equal(torch.randn(8, generator=g0), torch.randn(8, generator=g1))


def test_no_augmentation_draws_nothing():
    g = gen(5)
    before = g.get_state().clone()
    for step in range(1, 10):
        assert A.choose(CAP, CaptionAug(), step, g) == "full.v0"
        assert A.fresh(CAP, CaptionAug(keep_tokens=2), step, g) == CAP
    assert torch.equal(g.get_state(), before)
    assert not A.active(CaptionAug(keep_tokens=3, keep_tokens_separator="|||", token_warmup_step=0.001,
                                   max_steps=10))


def test_choose_dropout_rate_statistics():
    g = gen(123)
    aug = CaptionAug(caption_dropout_rate=0.3)
    dropped = sum(A.choose(CAP, aug, 1, g) is None for _ in range(2000))
    assert 0.25 * 2000 <= dropped <= 0.35 * 2000


# ------------------------------------------------------------------------------------------- fresh

def test_fresh():
    aug = CaptionAug(shuffle_caption=True, keep_tokens=1, caption_tag_dropout_rate=0.2, caption_dropout_rate=0.1,
                     token_warmup_step=4, token_warmup_min=1)
    a = [A.fresh(CAP, aug, s, gen(9)) for s in range(1, 8)]
    assert a == [A.fresh(CAP, aug, s, gen(9)) for s in range(1, 8)]
    g = gen(0)
    outs = [A.fresh(CAP, aug, 10, g) for _ in range(300)]
    assert 0.05 < outs.count("") / 300 < 0.16
    assert len(set(outs)) > 50
    for o in outs:
        if o:
            assert tags(o)[0] == "sks dog" and set(tags(o)) <= set(tags(CAP))
    # warm-up truncation: step 1 has the fixed tag plus at most token_warmup_min flex tags
    g = gen(0)
    for _ in range(50):
        o = A.fresh(CAP, CaptionAug(token_warmup_step=4, keep_tokens=1, shuffle_caption=True), 1, g)
        assert tags(o)[0] == "sks dog" and len(tags(o)) == 2
    # the draws do not depend on the outcome
    g0, g1 = gen(4), gen(4)
    A.fresh(CAP, CaptionAug(caption_dropout_rate=0.0, shuffle_caption=True), 1, g0)
    assert A.fresh(CAP, CaptionAug(caption_dropout_rate=1.0, shuffle_caption=True), 1, g1) == ""
    assert torch.equal(g0.get_state(), g1.get_state())


# ------------------------------------------------------------------------------------ config / logs

def test_from_config_and_errors():
    data = {"caption_dropout_rate": 0.1, "shuffle_caption": True, "keep_tokens": 1, "keep_tokens_separator": "|||",
            "caption_tag_dropout_rate": 0.05, "token_warmup_step": 0.5, "token_warmup_min": 2, "dir": "x"}
    aug = A.from_config(data, {"variants": 6, "cache": True}, max_steps=100)
    assert aug == CaptionAug(0.1, True, 1, "|||", 0.05, 0.5, 2, 6, 100)
    assert A.warmup_steps(aug) == 50 and A.active(aug) and A.randomizes(aug)
    assert A.from_config({}, None, 10) == CaptionAug(max_steps=10)
    assert not A.active(A.from_config({}, {}, 10))
    assert A.errors(data, {"variants": 6}) == []
    bad = A.errors({"caption_dropout_rate": 1.5, "caption_tag_dropout_rate": -0.1, "keep_tokens": -1,
                    "token_warmup_min": -2, "token_warmup_step": -1, "shuffle_caption": "yes"}, {"variants": 0})
    joined = "\n".join(bad)
    assert len(bad) == 7
    for key in ("data.caption_dropout_rate=1.5", "data.caption_tag_dropout_rate=-0.1", "data.keep_tokens=-1",
                "data.token_warmup_min=-2", "data.token_warmup_step=-1", "data.shuffle_caption='yes'",
                "text.variants=0"):
        assert key in joined
    assert "[0, 1]" in joined and ">= 1" in joined and ">= 0" in joined
    with pytest.raises(ValueError, match="text.variants=0"):
        A.from_config({}, {"variants": 0}, 10)


def test_describe():
    aug = CaptionAug(shuffle_caption=True, caption_tag_dropout_rate=0.1, variants=4)
    line = A.describe(aug, "cached")
    assert line.startswith("caption augmentation: shuffle + tag dropout 0.1 with the text cache: 4 cached variants")
    assert "text.fresh_draws=true" in line
    assert "fresh draw" in A.describe(aug, "fresh") and "text.cache=false" in A.describe(aug, "live")
    assert A.describe(CaptionAug(), "cached") == "caption augmentation: off"
    assert "warm-up" in A.describe(CaptionAug(token_warmup_step=4, caption_dropout_rate=0.1), "cached")
    with pytest.raises(ValueError):
        A.describe(aug, "nope")


@pytest.mark.parametrize("aug", [CaptionAug(), CaptionAug(keep_tokens=2), CaptionAug(keep_tokens_separator="|||"),
                                 CaptionAug(caption_dropout_rate=0.3, keep_tokens=1),
                                 CaptionAug(token_warmup_step=0.5, max_steps=10)])
def test_cached_texts_without_randomness_is_the_general_path(aug):
    # cached_texts answers the common case (no shuffle, no tag dropout, no warm-up) directly: 100,000 captions
    # in a no-op's keys. Whatever it answers must be what the general path computes.
    for caption in (CAP, "sks dog ||| red collar, grass", "", " a ,b,, c "):
        general = {A.label(n, i): A.variant(caption, aug, n, i, 7)
                   for n in A.warmup_lengths(caption, aug) for i in range(A._n_variants(aug))}
        assert A.cached_texts(caption, aug, 7) == general
