"""Loss options (issue 22, item 3): train.noise_offset, train.loss=l2|huber with train.huber_c, train.min_snr_gamma
(SD1.5/SDXL), each on a known input; in the train key only when they take effect; refused where they do not apply."""
from __future__ import annotations

from dataclasses import replace
import math

import pytest
import torch
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_snr

from tasks.config_schema import TrainConfig
from tasks import cache_latents, cache_text, train, validate
from tasks.config import compose, resolve_paths
from tasks.models.bases.losses import ddpm_loss, elementwise, flow_loss, min_snr_weights, offset_noise
from tasks.store import Store
from tolerance import approx, assert_close
from support import a_plan

NEW = ("train.noise_offset", "train.loss", "train.huber_c", "train.min_snr_gamma", "train.network", "train.rslora")
L2 = TrainConfig(loss="l2", huber_c=0.1, min_snr_gamma=None, noise_offset=0.0)


def _cfg(*overrides):
    return resolve_paths(compose("train", list(overrides))[0])


@pytest.mark.numerics
def test_huber_against_hand_values():
    pred, target = torch.tensor([[0.0, 0.05, 1.0, -3.0]]), torch.zeros(1, 4)
    # 2c(sqrt(d^2 + c^2) - c), c = 0.1: by hand
    hand = [0.0, 0.2 * (math.sqrt(0.0025 + 0.01) - 0.1), 0.2 * (math.sqrt(1.01) - 0.1), 0.2 * (math.sqrt(9.01) - 0.1)]
    huber = elementwise(pred, target, replace(L2, loss="huber"))
    # float32 against float64 by hand: a square, a sum, a root and a product an element (4 roundings)
    assert_close(huber, torch.tensor([hand]), n=1, stages=4, what="huber")
    assert_close(elementwise(pred, target, L2), torch.tensor([[0.0, 0.0025, 1.0, 9.0]]), n=1, what="l2")
    assert huber[0, 3] < 0.7  # an outlier pulls linearly (~2c|d|), not quadratically (9.0)
    # the families' mean losses use it; l2 at the defaults is exactly the old mse
    sched = DDPMScheduler()
    assert ddpm_loss(pred, target, replace(L2, loss="huber"), sched, None).item() == approx(sum(hand) / 4, n=4, stages=4)
    assert torch.equal(ddpm_loss(pred, target, L2, sched, None), torch.nn.functional.mse_loss(pred, target))
    ones = torch.ones(1, 1)
    assert flow_loss(pred, target, ones, replace(L2, loss="huber")).item() == approx(sum(hand) / 4, n=4, stages=4)


@pytest.mark.numerics
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_are_diffusers_example(prediction_type):
    sched = DDPMScheduler(prediction_type=prediction_type)
    t = torch.tensor([5, 100, 500, 999])
    snr = compute_snr(sched, t)
    # train_text_to_image_lora.py: min(snr, gamma) / snr (epsilon) or / (snr + 1) (v_prediction)
    expected = torch.minimum(snr, torch.full_like(snr, 5.0)) / (snr if prediction_type == "epsilon" else snr + 1)
    assert_close(min_snr_weights(sched, t, 5.0), expected, n=1, stages=3, what="min-snr weights")  # a min and a ratio
    pred, target = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 2, 3, 3)
    per_item = (pred ** 2).mean(dim=(1, 2, 3))
    loss = ddpm_loss(pred, target, replace(L2, min_snr_gamma=5.0), sched, t)
    assert_close(loss, (per_item * expected).mean(), n=pred.numel(), stages=2, what="weighted loss")
    if prediction_type == "epsilon":  # low-noise steps (high SNR) weigh little, high-noise ones fully
        assert expected[0] < 0.1 and expected[-1] == 1


@pytest.mark.numerics
def test_noise_offset_adds_one_constant_per_item_and_channel_from_its_generator():
    noise = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(9))

    def apply(offset):
        gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
        return offset_noise(noise, TrainConfig(noise_offset=offset), gens), gens

    out, gens = apply(0.1)
    shift = out - noise
    # constant over h, w: (noise + c) - noise is c to two roundings at the noise's magnitude
    assert_close(shift, shift[:, :, :1, :1].expand_as(shift), n=1, stages=2, magnitude=out.abs().max().item(),
                 what="offset")
    expected = torch.stack([0.1 * torch.randn((4, 1, 1), generator=torch.Generator().manual_seed(s)) for s in (1, 2)])
    assert_close(shift[:, :, :1, :1], expected, n=1, stages=2, magnitude=out.abs().max().item(), what="offset")
    assert torch.equal(apply(0.1)[0], out)  # same seeds, same noise
    untouched, gens = apply(0.0)
    assert untouched is noise  # off: no draw at all, so the generators' later draws are as before
    assert torch.equal(gens[0].get_state(), torch.Generator().manual_seed(1).get_state())


def test_options_refused_where_they_do_not_apply():
    flux = validate.config_errors(_cfg("train.min_snr_gamma=5"))
    assert any(e.startswith("train.min_snr_gamma=5") and "flow matching" in e for e in flux)
    assert not validate.config_errors(_cfg("model=tiny_sd15", "train.min_snr_gamma=5"))
    bad = validate.config_errors(_cfg("train.loss=l1", "train.huber_c=0", "train.noise_offset=-1"))
    assert {e.split("=")[0] for e in bad} == {"train.loss", "train.huber_c", "train.noise_offset"}


def test_options_enter_the_key_only_when_they_take_effect():
    plan = a_plan(family="sd15", ids={"denoiser": "d", "scheduler": "s"})
    default = train.inputs(_cfg(), plan, {}, {})
    assert not set(NEW) & set(default)  # so the key is the one a config had before these settings existed
    assert "train.huber_c" not in train.inputs(_cfg("train.huber_c=0.3"), plan, {}, {})  # no effect under l2
    keyed = train.inputs(_cfg("train.noise_offset=0.1", "train.loss=huber", "train.min_snr_gamma=5",
                              "train.network=dora", "train.rslora=true"), plan, {}, {})
    assert set(NEW) <= set(keyed)


def _train(store_root, *extra) -> dict:
    cfg = _cfg(f"store.root={store_root}", "train.batch_size=2", "train.max_steps=2", "train.log_with=none", *extra)
    store = Store(store_root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return train.run(cfg, plan, store, latents["items"], texts["items"])


def test_training_with_the_options_changes_the_lora_and_its_key(tmp_path):
    store = tmp_path / "store"
    plain = _train(store)
    again = _train(store, "train.noise_offset=0", "train.loss=l2", "train.huber_c=0.5")  # all at no effect
    assert again["key"] == plain["key"] and again["computed"] == 0
    huber = _train(store, "train.noise_offset=0.1", "train.loss=huber")
    assert huber["key"] != plain["key"]
    assert open(huber["lora"], "rb").read() != open(plain["lora"], "rb").read()
    assert huber["losses"][-1]["loss"] != plain["losses"][-1]["loss"]
    # the same config gives the same bytes (the offset comes from the per-item generators, not the global RNG)
    twin = _train(tmp_path / "twin", "train.noise_offset=0.1", "train.loss=huber")
    assert open(twin["lora"], "rb").read() == open(huber["lora"], "rb").read()


def test_min_snr_trains_an_epsilon_family(tmp_path):
    store = tmp_path / "store"
    plain = _train(store, "model=tiny_sd15")
    snr = _train(store, "model=tiny_sd15", "train.min_snr_gamma=5", "train.noise_offset=0.05")
    assert snr["key"] != plain["key"] and math.isfinite(snr["losses"][-1]["loss"])
    assert open(snr["lora"], "rb").read() != open(plain["lora"], "rb").read()


def test_resume_is_exact_with_the_options_and_dora(tmp_path):
    opts = ("train.noise_offset=0.1", "train.loss=huber", "train.network=dora", "export.format=diffusers",
            "train.rslora=true")
    straight = _train(tmp_path / "a", "train.max_steps=4", *opts)
    _train(tmp_path / "b", "train.max_steps=2", *opts)
    continued = _train(tmp_path / "b", "train.max_steps=4", *opts)
    assert continued["continued_from_step"] == 2
    assert open(straight["lora"], "rb").read() == open(continued["lora"], "rb").read()
