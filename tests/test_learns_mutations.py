"""Each training mutation of tests/learning.py trains a LoRA whose loss falls, yet the learning check
(bench/learns.py) must see that it learned the wrong thing: its ratio over the bound. Apart from
tests/test_learns.py so that `make test`'s workers run the two at once.

Where each mutation is tried, and why there:
- the target's sign: on a random tiny Flux (flow matching) and SD1.5 (DDPM), the two loss kinds;
- the timestep conventions and the latent normalisation: on the pretrained demo base (data/demo_base). A LoRA
  that memorises one image on a *random* base has no convention to break: it reads the noise level off its
  input, and learns the image in whatever latent scale the cache gives it; and a random base's render is so
  far from the image (err_base) that a latent off by 5.5x still counts as close. Measured, all under the
  bound: tiny_flux 0.07 reversed, 0.09 unscaled, 0.13 unnormalised; tiny_sd15 0.03 unscaled, 0.03 without
  its latent scale (0.18215). A base that has learned the conventions is what a wrong one fights, as a
  real checkpoint is: on the demo base a right LoRA lands at 0.0036 and these at 0.0195 (reversed), 0.057
  (unscaled) and 0.052 (unnormalised): over its bound (bench.learns.BOUNDS), though under the families' 0.2."""
from __future__ import annotations

import pytest

from bench import learns
from learning import TRAINING

CASES = [("tiny_flux", "sign"), ("tiny_sd15", "sign"),
         ("demo_flux", "timestep_reversed"), ("demo_flux", "timestep_unscaled"), ("demo_flux", "latent_scale")]


@pytest.mark.parametrize("model,mutation", CASES)
def test_training_mutation_is_caught(model, mutation, monkeypatch, tmp_path):
    family = "flux" if model == "demo_flux" else model.removeprefix("tiny_")
    TRAINING[mutation](monkeypatch, family)
    learns.dataset(tmp_path, model)
    base, files = learns.train_nodes(model, tmp_path)
    monkeypatch.undo()  # the check itself runs unmutated
    r = learns.evaluate(model, base, files)
    for fmt, ratio in r["files"].items():
        assert ratio > learns.bound(model), f"{model} {fmt}: {mutation} not caught (ratio {ratio:.4f})"


def test_every_mutation_is_tried():
    assert {m for _, m in CASES} == set(TRAINING)
