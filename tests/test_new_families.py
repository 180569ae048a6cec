"""The 2026 families (Z-Image, Qwen-Image, FLUX.2 [klein] and [dev]) keep every behaviour the older ones have,
checked cheaply at the node functions (4 demo images at 32 px, 3-4 steps; no Prefect, no CLI):

- the edit matrix (contract.md), every row, at the level of keys: which latents, texts, LoRA and sample images
  each edit gives new keys to (a node computes exactly the items whose keys the store lacks; that counting is
  family-independent and runs through the whole flow in tests/test_edit_matrix.py and tests/test_families.py);
- text.cache=false trains with the same losses as the cache;
- caption augmentation with the text cache (shuffled variants + dropout), then nothing re-encoded or retrained;
- exact resume: a run that fails after its step-2 checkpoint continues from it to the bytes of a straight run;
- train.num_processes=2 against one process (each such run starts two processes: ~6 s a family).

Sampling with negatives is checked per family in tests/test_sampling.py and tests/test_flux2_dev.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image
from safetensors.torch import load_file

from tasks import cache_latents, cache_text, sample, train, validate
from tasks.config import compose, resolve_paths
from tasks.store import Store

REPO = Path(__file__).resolve().parents[1]
NEW = ["zimage", "qwenimage", "flux2_klein", "flux2_dev"]
N = 4  # images
PROMPTS = "a red circle on a blue background\na green square --n blurry\na blue triangle --w 48 --h 32\n"


class Family:
    """4 demo images with tag captions, a prompts file and a store; runs the node functions on them."""

    def __init__(self, family: str, root: Path):
        self.family, self.root, self.data, self.store = family, root, root / "data", root / "store"
        self.data.mkdir(parents=True)
        for i in range(N):
            shutil.copy(REPO / "data" / "demo" / f"img_{i:02d}.png", self.data)
            caption = (REPO / "data" / "demo" / f"img_{i:02d}.txt").read_text().strip().replace(" on ", ", ")
            (self.data / f"img_{i:02d}.txt").write_text(caption + ", flat colors, toy\n")
        (root / "prompts.txt").write_text(PROMPTS)
        self.base = [f"model=tiny_{family}", f"sample.prompts_file={root / 'prompts.txt'}", f"store.root={self.store}",
                     "data.resolution=32", "train.max_steps=3", "train.batch_size=2", "train.log_every=1",
                     "sample.steps=2"]

    def cfg(self, *extra, data: Path | None = None) -> dict:
        return resolve_paths(compose("train", [*self.base, f"data.dir={data or self.data}", *extra])[0])

    def keys(self, *extra, data: Path | None = None):
        """(latent keys, text keys, LoRA key, sample keys) of a run with these overrides."""
        cfg = self.cfg(*extra, data=data)
        plan = validate.run(cfg, Store(self.store))
        lat, txt = cache_latents.item_keys(cfg, plan), cache_text.item_keys(cfg, plan)
        lora = train.key_of_node(cfg, plan, lat, txt)
        return lat, txt, lora, sample.item_keys(cfg, plan, lora, txt)

    def train(self, *extra) -> tuple[dict, dict]:
        """(cache_text's result, train's result), every node before train run as the flow runs them."""
        cfg, store = self.cfg(*extra), Store(self.store)
        plan = validate.run(cfg, store)
        lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
        return txt, train.run(cfg, plan, store, lat["items"], txt["items"])


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
    assert counts("data.resolution=48") == (N, 0, "ran", 3)
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
    assert _losses(live) == pytest.approx(_losses(cached), rel=1e-6)


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


@pytest.mark.parametrize("family", NEW)
def test_two_processes_match_one(family, make):
    """As tests/test_multiprocess.py for Flux, at the same global batch: losses to float rounding."""
    fam = make(family)
    _, one = fam.train("train.max_steps=4", "train.batch_size=4")
    _, two = fam.train("train.max_steps=4", "train.batch_size=4", "train.num_processes=2")
    assert two["computed"] == 1 and two["key"] != one["key"]
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5)
    a, b = load_file(one["lora"]), load_file(two["lora"])
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
