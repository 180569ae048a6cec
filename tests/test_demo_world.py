"""The demo world (tasks/demo/world.py) and its scorer (tasks/demo/score.py): fast, no torch."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from PIL import Image, ImageFilter

from tasks.demo import score, world

ALL = world.base_captions() + world.concept_captions()


def _img(text: str) -> Image.Image:
    return world.render(*world.parse(text))


def test_render_is_deterministic_and_sized():
    a, b = _img("a red circle on a blue background"), _img("a red circle on a blue background")
    assert a.size == (64, 64) and a.mode == "RGB"
    assert hashlib.sha256(a.tobytes()).digest() == hashlib.sha256(b.tobytes()).digest()


def test_captions():
    assert len(world.base_captions()) == 3 * 8 * 7 and len(world.concept_captions()) == 8 * 7
    assert world.parse("a red zkx on a blue background") == ("zkx", "red", "blue")
    assert all(world.CONCEPT not in c for c in world.base_captions())
    train = world.concept_train_captions()
    assert set(train) <= set(world.concept_captions()) and len(set(train)) == len(train)
    with pytest.raises(ValueError):
        world.parse("a red circle on a red-ish background")
    with pytest.raises(ValueError):
        world.render("circle", "red", "red")


def test_every_world_image_shows_its_caption():
    assert score.share([_img(c) for c in ALL], ALL) == 1.0


@pytest.mark.parametrize("wrong", [
    "a red square on a blue background",     # shape
    "a red zkx on a blue background",        # the concept is not a circle
    "a green circle on a blue background",   # colour
    "a red circle on a white background",    # background
])
def test_rejects_wrong_captions(wrong):
    assert not score.shows(_img("a red circle on a blue background"), wrong)


def test_concept_and_base_shapes_kept_apart():
    for colour, background in [("white", "black"), ("yellow", "magenta"), ("cyan", "red")]:
        concept = world.render(world.CONCEPT, colour, background)
        assert score.read(concept)[0] == world.CONCEPT
        for s in world.SHAPES:
            assert not score.shows(concept, world.caption(s, colour, background))
            assert score.read(world.render(s, colour, background))[0] == s


def test_robust_to_blur_resize_noise_and_shift():
    rng = np.random.default_rng(0)
    for text in ALL[::7]:
        im = _img(text)
        noisy = np.asarray(im, np.float32) + rng.normal(0, 25, (64, 64, 3))
        shifted = np.roll(np.asarray(im), (3, -2), (0, 1))
        for variant in (im.filter(ImageFilter.GaussianBlur(1.5)), im.resize((32, 32)).resize((64, 64)),
                        im.resize((128, 128)), Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)),
                        Image.fromarray(shifted)):
            assert score.shows(variant, text), text


def test_empty_image_shows_nothing():
    assert score.read(Image.new("RGB", (64, 64), (0, 0, 255))) == (None, None, "blue")
    assert score.share([Image.new("RGB", (64, 64))], ["a red circle on a black background"]) == 0.0


def test_concept_dataset(tmp_path):
    world.write_concept_dataset(tmp_path / "a")
    world.write_concept_dataset(tmp_path / "b")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(files) == 2 * (len(world.concept_train_captions()) + len(world.regularisation_captions()))
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        if name.endswith(".txt"):
            text = (tmp_path / "a" / name).read_text().strip()
            assert score.shows(Image.open(tmp_path / "a" / name.replace(".txt", ".png")), text)


def test_world_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, tasks.demo.world, tasks.demo.score; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
