"""Issue 48: the learning check on images it was not tuned on (bench/learns_images.py). The bench runs every family
on every generated image (`python -m bench.learns`: bench/learns.json `families.<model>.images`); the suite runs the
issue's own failing case, a high-contrast pattern with a one-word caption, on the two families it failed for
(FLUX.1 0.35, SD3 0.50 on 11-26), at the family's one setting, and checks the images are drawn, not chosen: fixed
bytes from fixed seeds, each kind what its name says."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from bench import learns
from bench.learns_images import NAMES, generated

REPO = Path(__file__).resolve().parents[1]


def test_the_images_are_fixed_and_of_their_kind():
    assert len(NAMES) >= 4
    images = {n: generated(n, learns.SIZE) for n in NAMES}
    for n, (img, caption) in images.items():
        again, _ = generated(n, learns.SIZE)
        assert img.size == (learns.SIZE, learns.SIZE) and img.mode == "RGB" and caption
        assert hashlib.sha256(img.tobytes()).digest() == hashlib.sha256(again.tobytes()).digest(), n
    a = {n: np.asarray(img, dtype=np.float64) for n, (img, _) in images.items()}
    step = {n: np.abs(np.diff(x, axis=1)).mean() for n, x in a.items()}  # mean horizontal change a pixel
    assert step["gradient"] < 5 < step["checkers"] and step["pattern"] > 20  # smooth / periodic / high contrast
    assert len(np.unique(a["pattern"])) == 2 and images["pattern"][1] == "stripes"  # black and white, one word


@pytest.mark.parametrize("model", ["tiny_flux", "tiny_sd3"])
def test_the_issues_pattern_is_learned(model, tmp_path):
    learns.dataset(tmp_path, model, "pattern")
    base, files = learns.train_nodes(model, tmp_path)
    r = learns.evaluate(model, base, files, "pattern")
    assert max(r["files"].values()) <= learns.bound(model), r["files"]


def test_the_bench_records_every_family_on_every_image():
    """bench/learns.json (contract: `families.<model>.images`): each family checked on the generated images."""
    families = json.loads((REPO / "bench" / "learns.json").read_text())["families"]
    recorded = {m: f["images"] for m, f in families.items() if "images" in f}
    assert {"tiny_flux", "tiny_sd3", "tiny_sdxl"} <= set(recorded)
    for model, images in recorded.items():
        assert set(images) == set(NAMES), model
