"""Gradient accumulation and flow-matching timestep shift (issue 18, item 5): train.gradient_accumulation_steps
(exact resume across accumulation boundaries), train.timestep_sampling=uniform|shift|flux_shift with
train.discrete_flow_shift (sd-scripts' options, diffusers' shift formulas); keys of earlier runs unchanged."""
from __future__ import annotations


from dataclasses import replace
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from tasks.config_schema import TrainConfig
from tasks import cache_latents, cache_text, train, validate
from tasks.training import batches
from tasks.config import compose, resolve_paths
from tasks.models.bases.flow_matching import noise_latents, shifted_sigmas
from tasks.store import Store
from tolerance import assert_close
from support import a_plan

NEW = ("train.gradient_accumulation_steps", "train.timestep_sampling", "train.discrete_flow_shift")


def _cfg(*overrides):
    return resolve_paths(compose("train", list(overrides))[0])


def _train(store_root, *extra) -> dict:
    cfg = _cfg(f"store.root={store_root}", "train.batch_size=2", "train.log_every=1", "train.log_with=none", *extra)
    store = Store(store_root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return train.run(cfg, plan, store, latents["items"], texts["items"])


def test_new_settings_enter_the_key_only_when_they_take_effect():
    plan = a_plan(family="flux", ids={"denoiser": "d", "scheduler": "s"})
    assert not set(NEW) & set(train.inputs(_cfg(), plan, {}, {}))
    assert not set(NEW) & set(train.inputs(_cfg("train.discrete_flow_shift=5"), plan, {}, {}))
    keyed = train.inputs(_cfg("train.gradient_accumulation_steps=2", "train.timestep_sampling=shift"), plan, {}, {})
    assert set(NEW) <= set(keyed)


def test_accumulation_resumes_exactly_and_draws_each_micro_batch(tmp_path, monkeypatch):
    calls = []
    real = batches.batch_at  # the batch loader's draw (tasks/training/batches.py)
    monkeypatch.setattr(batches, "batch_at", lambda step, *a: calls.append(step) or real(step, *a))
    straight = _train(tmp_path / "a", "train.max_steps=4", "train.gradient_accumulation_steps=2")
    assert calls == list(range(1, 9))  # 4 optimizer steps of 2 micro-batches
    _train(tmp_path / "b", "train.max_steps=2", "train.gradient_accumulation_steps=2")
    continued = _train(tmp_path / "b", "train.max_steps=4", "train.gradient_accumulation_steps=2")
    assert continued["continued_from_step"] == 2
    assert open(straight["lora"], "rb").read() == open(continued["lora"], "rb").read()
    plain = _train(tmp_path / "c", "train.max_steps=4")
    assert plain["key"] != straight["key"] and len(plain["losses"]) == len(straight["losses"]) == 4


@pytest.mark.numerics
def test_shift_formulas_are_diffusers():
    u = torch.linspace(0.01, 0.99, 50)
    # the static shift of FlowMatchEulerDiscreteScheduler (SD3's shift=3.0 table)
    # the same formula in another order of operations: a few float32 roundings an element (n=1, 4 stages)
    assert_close(shifted_sigmas(FlowMatchEulerDiscreteScheduler(shift=1.0).sigmas[:-1], "shift", 3.0, (64, 64)),
                 FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas[:-1], n=1, stages=4, what="static shift")
    # Flux: mu from the packed sequence length, the scheduler's exponential time shift
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    mu = calculate_shift(64 * 64)
    assert_close(shifted_sigmas(u, "flux_shift", 3.0, (128, 128)), sched.time_shift(mu, 1.0, u), n=1, stages=4,
                 what="flux time shift")
    assert torch.equal(shifted_sigmas(u, "uniform", 3.0, (8, 8)), u)
    assert float(shifted_sigmas(torch.tensor(0.5), "shift", 3.0, (8, 8))) == 0.75  # 1.5 / 2: exact in binary


@pytest.mark.numerics
def test_shift_moves_sigmas_up_and_feeds_matching_timesteps():
    latents = torch.zeros(64, 4, 8, 8)
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0)
    base = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, discrete_flow_shift=3.0)

    def draw(mode):
        gens = [torch.Generator().manual_seed(i) for i in range(64)]
        _, _, timesteps, sigmas = noise_latents(latents, replace(base, timestep_sampling=mode), sched, gens)
        return timesteps, sigmas.flatten()

    t_uniform, s_uniform = draw("uniform")
    t_shift, s_shift = draw("shift")
    assert (s_shift >= s_uniform).all() and s_shift.mean() > s_uniform.mean() + 0.1
    assert_close(t_shift, s_shift * 1000, n=1, what="timesteps = 1000 sigma")  # one rounding of the product


@pytest.mark.parametrize("model", ["tiny_sdxl", "tiny_sd15"])
def test_shift_refused_for_ddpm_families(model):
    errors = validate.config_errors(_cfg(f"model={model}", "train.timestep_sampling=shift"))
    assert any(e.startswith("train.timestep_sampling=shift: flow-matching families only") for e in errors)
    assert not validate.config_errors(_cfg("model=tiny_sd3", "train.timestep_sampling=flux_shift"))
