"""fp16 weights without loss scaling (issue 18, item 2): with model.dtype=float16 (the sd15 / sdxl_base
configs) training always runs under accelerate's fp16 autocast with its GradScaler, the LoRA weights fp32,
as the references do; what cannot run that way is refused before any work, naming the fix."""
from __future__ import annotations

import torch

from tasks.config import compose, resolve_paths
from tasks.training.train_key import inputs
from tasks.training.train_setup import precision
from tasks.validate import config_errors
from support import a_plan


def _cfg(*overrides):
    return resolve_paths(compose("train", list(overrides))[0])


def _dtype_errors(*overrides):
    return [e for e in config_errors(_cfg(*overrides)) if e.startswith("model.dtype=float16")]


def test_fp16_weights_always_train_with_loss_scaling():
    for model in ("sdxl_base", "sd15"):
        for mp in ("no", "fp16"):
            assert precision(_cfg(f"model={model}", f"train.mixed_precision={mp}")) == "fp16"
    assert precision(_cfg("model=tiny_sdxl")) == "no"
    assert precision(_cfg("model=tiny_sdxl", "train.mixed_precision=bf16")) == "bf16"


def test_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _dtype_errors("model=sdxl_base") == [] and _dtype_errors("model=sd15", "train.mixed_precision=fp16") == []
    assert "train.mixed_precision=bf16 contradicts it" in _dtype_errors("model=sdxl_base", "train.mixed_precision=bf16")[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (error,) = _dtype_errors("model=tiny_sdxl", "model.dtype=float16")
    assert "needs a CUDA GPU" in error and "model.dtype=bfloat16 or float32" in error


def test_the_train_key_says_so_only_for_fp16_weights():
    plan = a_plan(family="sdxl", ids={"denoiser": "d", "scheduler": "s"})
    assert inputs(_cfg("model=sdxl_base"), plan, {}, {})["loss_scaling"] == "fp16"
    assert "loss_scaling" not in inputs(_cfg("model=tiny_sdxl"), plan, {}, {})
