"""Memory options on the CPU: an fp8-stored base (tasks/training/fp8_base.py; never an fp8 embedding lookup),
gradient checkpointing, mixed precision through accelerate, and clear errors for what needs CUDA."""
from __future__ import annotations

import pytest
import torch

from tasks.config_schema import ModelConfig, TrainConfig
from tasks.config import ConfigError, config_of
from tasks.models import make_adapter, resolve_model
from tasks.store import Store
from tasks.training.train_setup import prepare_denoiser

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _cfg(storage=None, checkpointing=False, modulation=False):
    return config_of({"model": {"family": "flux", "dtype": "bfloat16", "max_sequence_length": 32, "storage_dtype": storage,
                      "storage_modulation": modulation},
            "train": {"rank": 4, "alpha": None, "target_modules": None, "gradient_checkpointing": checkpointing}})


@pytest.mark.parametrize("family,modulation", [("flux", False), ("flux", True), ("sd3", True), ("sdxl", False)])
def test_fp8_base_keeps_embeddings_norms_and_lora_out_of_fp8(family, modulation, tmp_path):
    model = ModelConfig(family=family, path=None, seed=0, arch={}, dtype="bfloat16", max_sequence_length=32)
    adapter = make_adapter(model, resolve_model(model, Store(tmp_path)))
    cfg = _cfg("float8_e4m3fn", modulation=modulation)
    cfg.model.family = family
    denoiser, named = prepare_denoiser(adapter, cfg)

    dtypes = {n: p.dtype for n, p in denoiser.named_parameters()}
    assert any(d in FP8 for n, d in dtypes.items() if "base_layer" in n)  # the frozen Linear weights
    modulation_linears = {n: d for n, d in dtypes.items()  # AdaLN (Flux, SD3); biases stay bf16
                          if ".norm" in n and ".linear." in n and n.endswith(".weight")}
    assert all((d in FP8) == modulation for d in modulation_linears.values())
    assert modulation_linears or family == "sdxl"
    assert all(p.dtype == torch.float32 for p in named.values()) and all("lora_" in n for n in named)
    for name, module in denoiser.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.GroupNorm)):
            assert all(p.dtype not in FP8 for p in module.parameters(recurse=False)), name

    lookups = []
    embedding = torch.nn.functional.embedding

    def checked_embedding(input, weight, *a, **k):
        lookups.append(weight.dtype)
        return embedding(input, weight, *a, **k)

    torch.nn.functional.embedding = checked_embedding
    try:
        pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
        latents = adapter.encode_latents(adapter.load_vae(), pixels.to(torch.bfloat16)).to(torch.bfloat16)
        text = {k: v[None] for k, v in adapter.encode_text(adapter.load_text_encoders(), ["a red circle"])[0].items()}
        train_cfg = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, guidance=1.0)
        loss = adapter.training_loss(denoiser, latents, text, train_cfg, adapter.load_train_scheduler(),
                                     [torch.Generator().manual_seed(0)])
        loss.backward()
    finally:
        torch.nn.functional.embedding = embedding
    assert torch.isfinite(loss) and all(p.grad is not None for p in named.values())
    assert all(d not in FP8 for d in lookups)


def test_memory_options_through_the_dag(workspace):
    short = ("train.max_steps=3", "train.log_every=1", "train.seed=11")
    plain = workspace.run(*short)
    checkpointed = workspace.run(*short, "train.gradient_checkpointing=true")
    assert checkpointed["nodes"]["train"]["status"] == "ran"
    # recomputing the forward runs the same kernels on the same inputs: the same numbers
    assert [e["loss"] for e in checkpointed["loss"]] == [e["loss"] for e in plain["loss"]]

    bf16 = workspace.run(*short, "train.mixed_precision=bf16")
    assert bf16["nodes"]["train"]["status"] == "ran"
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in bf16["loss"])
    assert [e["loss"] for e in bf16["loss"]] != [e["loss"] for e in plain["loss"]]  # autocast did act

    fp8 = workspace.run(*short, "model.storage_dtype=float8_e4m3fn")
    assert fp8["nodes"]["train"]["status"] == "ran" and len(fp8["artifacts"]["samples"]) == 3
    fp8_all = workspace.run(*short, "model.storage_dtype=float8_e4m3fn", "model.storage_modulation=true")
    assert fp8_all["nodes"]["train"]["status"] == "ran" and fp8_all["nodes"]["train"]["key"] != fp8["nodes"]["train"]["key"]
    assert [e["loss"] for e in fp8_all["loss"]] != [e["loss"] for e in fp8["loss"]]  # the modulation did go fp8
    # without a storage dtype the setting changes nothing, nor the key: the plain run's LoRA is reused
    assert workspace.run(*short, "model.storage_modulation=true")["nodes"]["train"]["status"] == "cached"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages on a machine without CUDA")
@pytest.mark.parametrize("override,named", [("train.mixed_precision=fp16", "train.mixed_precision=bf16"),
                                            ("train.optimizer=adamw8bit", "train.optimizer=adamw"),
                                            ("model.storage_dtype=int4", "float8_e4m3fn")])
def test_what_this_machine_cannot_run_names_the_alternative(workspace, override, named):
    with pytest.raises(ConfigError) as e:
        workspace.run(override)
    assert override.split("=")[0] in str(e.value) and named in str(e.value)
