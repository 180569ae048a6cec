"""train.optimizer (issue 22, item 4): prodigy (prodigyopt), adafactor (transformers'), lion8bit (bitsandbytes,
CUDA only) besides adamw / adamw8bit. Each trains, and resumes exactly: its state (Prodigy's per-group d, k, ...,
Adafactor's factored moments and int step) round-trips through a checkpoint."""
from __future__ import annotations

import pytest
import torch

from tasks.config_schema import TrainConfig
from tasks import cache_latents, cache_text, train, validate
from tasks.training.checkpoints import load_checkpoint, save_checkpoint
from tasks.config import ConfigError, compose, resolve_paths
from tasks.store import Store
from tasks.training.train_setup import make_optimizer


def _cfg(*overrides):
    return resolve_paths(compose("train", list(overrides))[0])


def _train(store_root, *extra) -> dict:
    cfg = _cfg(f"store.root={store_root}", "train.batch_size=2", "train.log_with=none", "export.format=diffusers", *extra)
    store = Store(store_root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return train.run(cfg, plan, store, latents["items"], texts["items"])


def _steps(opt, params, first, last):
    for i in range(first, last):
        g = torch.Generator().manual_seed(i)
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("name,lr", [("prodigy", 1.0), ("adafactor", 1e-2), ("adamw", 1e-2)])
def test_optimizer_state_round_trips_through_a_checkpoint(tmp_path, name, lr):
    tc = TrainConfig(optimizer=name, lr=lr, weight_decay=0.01)
    torch.manual_seed(0)
    a = {"w": torch.nn.Parameter(torch.randn(3, 4)), "b": torch.nn.Parameter(torch.randn(4))}
    opt_a = make_optimizer(tc, list(a.values()))
    _steps(opt_a, a, 0, 3)
    store = Store(tmp_path)
    save_checkpoint(store, "0" * 64, 3, a, opt_a, [], {})
    b = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in a.items()}
    opt_b = make_optimizer(tc, list(b.values()))
    load_checkpoint(store, "0" * 64, b, opt_b)
    if name == "prodigy":  # the per-group values, exact (JSON, not float32 tensors)
        assert {k: opt_b.param_groups[0][k] for k in ("d", "d_numerator", "k")} == \
               {k: opt_a.param_groups[0][k] for k in ("d", "d_numerator", "k")}
    if name == "adafactor":
        assert opt_b.state[b["w"]]["step"] == 3 and isinstance(opt_b.state[b["w"]]["step"], int)
    _steps(opt_a, a, 3, 6)
    _steps(opt_b, b, 3, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("opts", [("train.optimizer=prodigy", "train.lr=1.0"), ("train.optimizer=adafactor",)],
                         ids=["prodigy", "adafactor"])
def test_resume_is_exact_with_the_optimizer(tmp_path, opts):
    straight = _train(tmp_path / "a", "train.max_steps=4", *opts)
    _train(tmp_path / "b", "train.max_steps=2", *opts)
    continued = _train(tmp_path / "b", "train.max_steps=4", *opts)
    assert continued["continued_from_step"] == 2
    assert open(straight["lora"], "rb").read() == open(continued["lora"], "rb").read()
    assert straight["inputs"]["train.optimizer"] == opts[0].split("=")[1]


def test_8bit_optimizers_are_refused_without_cuda_and_bitsandbytes(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal")
    for name in ("lion8bit", "adamw8bit"):
        cfg = _cfg(f"store.root={tmp_path}", f"train.optimizer={name}")
        with pytest.raises(ConfigError, match=f"train.optimizer={name} needs .*train.optimizer=adamw"):
            validate.run(cfg, Store(tmp_path))
    cfg = _cfg(f"store.root={tmp_path}", "train.optimizer=sgd")
    with pytest.raises(ConfigError, match="train.optimizer='sgd': choose one of .*prodigy, adafactor, lion8bit"):
        validate.run(cfg, Store(tmp_path))
