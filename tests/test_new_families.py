"""The 2026 families (Z-Image, Qwen-Image, FLUX.2 [klein] and [dev]) keep every behaviour the older ones have,
checked cheaply at the node functions (4 demo images at 32 px, 3-4 steps; no Prefect, no CLI):

- the edit matrix (contract.md), every row, at the level of keys: which latents, texts, LoRA and sample images
  each edit gives new keys to (a node computes exactly the items whose keys the store lacks; that counting is
  family-independent and runs through the whole flow in tests/test_edit_matrix.py and tests/test_families.py);
- text.cache=false trains with the same losses as the cache;
- caption augmentation with the text cache (shuffled variants + dropout), then nothing re-encoded or retrained;
- exact resume: a run that fails after its step-2 checkpoint continues from it to the bytes of a straight run;

Sampling with negatives is checked per family in tests/test_sampling.py and tests/test_flux2_dev.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image

from tasks import train
from tasks.models import adapter_class

from families import N, NEW, PROMPTS, REPO, Family


_MADE: dict[str, Family] = {}


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    def get(family: str) -> Family:
        if family not in _MADE:
            _MADE[family] = Family(family, tmp_path_factory.mktemp(f"new-{family}"))
        return _MADE[family]
    yield get
    _MADE.clear()


def _losses(result) -> list[float]:
    return [e["loss"] for e in result["losses"]]


def _edited(fam: Family, edit) -> Path:
    """A copy of the family's data folder with one edit made."""
    data = fam.root / f"edit{len(list(fam.root.glob('edit*')))}"
    shutil.copytree(fam.data, data)
    edit(data)
    return data


def _recolour(data):
    img = Image.open(data / "img_01.png").convert("RGB")
    img.putpixel((0, 0), (255 - img.getpixel((0, 0))[0], 0, 0))
    img.save(data / "img_01.png")


def _add(data):
    shutil.copy(REPO / "data" / "demo" / "img_05.png", data / "img_05.png")
    (data / "img_05.txt").write_text("an added image\n")


@pytest.mark.parametrize("family", NEW)
def test_edit_matrix_rows_give_new_keys_to_exactly_the_items_to_recompute(family, make):
    fam = make(family)
    lat0, txt0, lora0, smp0 = fam.keys()

    def counts(*extra, data=None):
        lat, txt, lora, smp = fam.keys(*extra, data=data)
        return (len(set(lat.values()) - set(lat0.values())), len(set(txt.values()) - set(txt0.values())),
                "ran" if lora != lora0 else "cached", len(set(smp.values()) - set(smp0.values())))

    assert len(lat0) == N and len(smp0) == 3 and len(txt0) == N + 3 + 2  # captions, prompts, a negative, ""
    assert counts() == (0, 0, "cached", 0)
    assert counts(data=_edited(fam, lambda d: None)) == (0, 0, "cached", 0)  # the same files elsewhere
    prompts = fam.root / "prompts_edited.txt"
    prompts.write_text(PROMPTS.replace("green square", "purple square"))
    assert counts(f"sample.prompts_file={prompts}") == (0, 1, "cached", 1)
    for override in ("sample.steps=3", "sample.cfg=2.0", "sample.seed=7"):
        assert counts(override) == (0, 0, "cached", 3), override
    caption = _edited(fam, lambda d: (d / "img_02.txt").write_text("a caption edited for this family\n"))
    assert counts(data=caption) == (0, 1, "ran", 3)
    assert counts(data=_edited(fam, _recolour)) == (1, 0, "ran", 3)
    assert counts(data=_edited(fam, _add)) == (1, 1, "ran", 3)
    removed = _edited(fam, lambda d: [(d / f"img_03{ext}").unlink() for ext in (".png", ".txt")])
    assert counts(data=removed) == (0, 0, "ran", 3)
    # another training size: 48 px, or 64 where sides are multiples of 32 (Qwen-Image 2.1)
    other_size = 48 if 48 % adapter_class(family).size_multiple == 0 else 64
    assert counts(f"data.resolution={other_size}") == (N, 0, "ran", 3)
    for override in ("train.lr=5e-3", "train.rank=2", "train.max_steps=4", "train.seed=1"):
        assert counts(override) == (0, 0, "ran", 3), override
    other = "tiny_sd15" if family != "zimage" else "tiny_qwenimage"
    assert counts(f"model={other}") == (N, len(txt0), "ran", 3)


@pytest.mark.parametrize("family", NEW)
def test_text_cache_off_gives_the_same_losses(family, make):
    fam = make(family)
    _, cached = fam.train()
    _, live = fam.train("text.cache=false")
    assert live["computed"] == 1 and live["key"] != cached["key"]
    assert _losses(live) == _losses(cached)  # one caption at a time, live or cached: the same tensors


@pytest.mark.parametrize("family", NEW)
def test_caption_augmentation_trains_from_cached_variants(family, make):
    fam = make(family)
    aug = ("data.shuffle_caption=true", "text.variants=2", "data.caption_dropout_rate=0.3")
    texts, first = fam.train(*aug)
    assert texts["caption_texts"] == 2 * N and texts["computed"] > 0  # two cached shuffles per caption
    assert first["computed"] == 1 and all(0 < x < 10 for x in _losses(first))
    assert _losses(first) != _losses(fam.train()[1])  # the variants are what trained
    texts, again = fam.train(*aug)
    assert texts["computed"] == 0 and again["computed"] == 0  # nothing re-encoded, the LoRA reused


@pytest.mark.parametrize("family", NEW)
def test_a_failed_run_resumes_from_its_checkpoint_to_the_bytes_of_a_straight_run(family, make, monkeypatch):
    fam = make(family)
    steps = ("train.max_steps=4", "train.save_every_n_steps=2", "train.seed=5")
    real = train._save_checkpoint

    def save_then_fail(store, key, step, *args, **kwargs):
        real(store, key, step, *args, **kwargs)
        if step == 2:
            raise RuntimeError("killed after the step-2 checkpoint")

    monkeypatch.setattr(train, "_save_checkpoint", save_then_fail)
    with pytest.raises(RuntimeError, match="step-2 checkpoint"):
        fam.train(*steps)
    monkeypatch.setattr(train, "_save_checkpoint", real)
    _, resumed = fam.train(*steps)
    assert resumed["continued_from_step"] == 2 and resumed["computed"] == 1
    _, straight = fam.train(*steps, "train.resume=never")
    assert straight["continued_from_step"] is None and straight["key"] != resumed["key"]
    assert Path(resumed["lora"]).read_bytes() == Path(straight["lora"]).read_bytes()
    assert _losses(resumed) == _losses(straight)
