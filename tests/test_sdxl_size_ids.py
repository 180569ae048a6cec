"""SDXL's size conditioning (issue 18, item 1): each image's size before resizing and its crop offsets are
recorded with its latent and reach the UNet's add_time_ids, as in diffusers' SDXL LoRA example and
sd-scripts (not `[h, w, 0, 0, h, w]` for every image)."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from tasks import cache_latents, cache_text, train, validate  # noqa: E402
from tasks.config import compose, resolve_paths  # noqa: E402
from tasks.models.sdxl import SDXLAdapter  # noqa: E402
from tasks.store import Store  # noqa: E402


def _data(root):
    root.mkdir()
    for name, size in (("wide", (96, 64)), ("tall", (64, 128)), ("square", (32, 32))):
        Image.new("RGB", size, (200, 30, 30)).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(f"a {name} red image")
    return root


def test_original_size_and_crop_reach_add_time_ids(tmp_path, monkeypatch):
    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}", f"data.dir={_data(tmp_path / 'd')}",
                                          "model=tiny_sdxl", "train.max_steps=2", "train.batch_size=3",
                                          "train.log_with=none"])[0])
    store = Store(tmp_path / "store")
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    stored = {n: store.get_tensors("latents", k) for n, k in latents["items"].items()}
    # (h, w) before resizing; (top, left) of the centre crop in the resized image (64x64 training size)
    assert stored["wide.png"]["original_size"].tolist() == [64, 96]
    assert stored["wide.png"]["crop_top_left"].tolist() == [0, 16]
    assert stored["tall.png"]["original_size"].tolist() == [128, 64]
    assert stored["tall.png"]["crop_top_left"].tolist() == [32, 0]
    assert stored["square.png"]["original_size"].tolist() == [32, 32]
    assert stored["square.png"]["crop_top_left"].tolist() == [0, 0]

    seen = []
    original = SDXLAdapter.added_cond_kwargs

    def spy(self, text, lat):
        out = original(self, text, lat)
        seen.extend(tuple(r) for r in out["time_ids"].long().tolist())
        return out

    monkeypatch.setattr(SDXLAdapter, "added_cond_kwargs", spy)
    train.run(cfg, plan, store, latents["items"], texts["items"])
    assert set(seen) == {(64, 96, 0, 16, 64, 64), (128, 64, 32, 0, 64, 64), (32, 32, 0, 0, 64, 64)}


def test_other_families_store_the_latent_alone(tmp_path):
    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}", f"data.dir={_data(tmp_path / 'd')}"])[0])
    store = Store(tmp_path / "store")
    plan = validate.run(cfg, store)
    for key in cache_latents.run(cfg, plan, store)["items"].values():
        assert set(store.get_tensors("latents", key)) == {"latents"}  # Flux: bytes and keys as before


def test_a_bare_call_is_uncropped_at_the_training_size():
    adapter = SDXLAdapter.__new__(SDXLAdapter)
    out = adapter.added_cond_kwargs({"pooled_prompt_embeds": torch.zeros(2, 4)}, torch.zeros(2, 4, 8, 16))
    assert out["time_ids"].tolist() == [[64, 128, 0, 0, 64, 128]] * 2
