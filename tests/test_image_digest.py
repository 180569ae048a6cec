"""An image edited between validate and cache_latents (issue 18, item 7): cache_latents hashes the bytes it
decodes (read once), so new pixels are never stored under the old bytes' key; the run fails naming the
image, and the next run finds the new latent under the new bytes' key."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from tasks import cache_latents, validate  # noqa: E402
from tasks.config import ConfigError, compose, resolve_paths  # noqa: E402
from tasks.store import Store  # noqa: E402


def _data(root):
    root.mkdir()
    for i, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        Image.new("RGB", (64, 64), colour).save(root / f"img_{i}.png")
        (root / f"img_{i}.txt").write_text(f"image {i}")
    return root


def test_new_pixels_never_land_under_the_old_key(tmp_path):
    data = _data(tmp_path / "d")
    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}", f"data.dir={data}"])[0])
    store = Store(tmp_path / "store")
    plan = validate.run(cfg, store)
    old_keys = cache_latents.item_keys(cfg, plan)
    Image.new("RGB", (64, 64), (250, 250, 0)).save(data / "img_1.png")  # edited after validate
    with pytest.raises(ConfigError, match=r"changed on disk after validate: img_1.png.*run again"):
        cache_latents.run(cfg, plan, store)
    assert not store.valid("latents", old_keys["img_1.png"])  # nothing stored under the old bytes
    assert store.valid("latents", old_keys["img_0.png"]) and store.valid("latents", old_keys["img_2.png"])

    again = validate.run(cfg, store)  # the next run: the new bytes' latent is already there
    result = cache_latents.run(cfg, again, store)
    assert (result["computed"], result["reused"]) == (0, 3)
    assert result["items"]["img_1.png"] != old_keys["img_1.png"]


def test_read_image_digests_the_bytes_it_decodes(tmp_path):
    from tasks.store.hashing import digest_file
    from tasks.data.images import read_image

    path = tmp_path / "a.png"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(path)
    img, digest = read_image(path)
    assert digest == digest_file(path) and img.getpixel((0, 0)) == (1, 2, 3)
