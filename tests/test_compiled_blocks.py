"""Issue 45 item 3: `train.compile=true` compiles the denoiser's repeated blocks (tasks/training/compiled_blocks.py)
with gradient checkpointing and the LoRA in place; a step's loss and LoRA gradients equal eager's within fp32
rounding; the setting is in the LoRA's key; the report names the kernels; a machine without a compiler is
told so in one line."""
from __future__ import annotations

from dataclasses import replace
import json
from pathlib import Path

import pytest
import torch

from tasks.config import config_of
from tasks.config_schema import ModelConfig, TrainConfig
from tasks.models import make_adapter, resolve_model
from tasks.store import Store
from tasks.training import compiled_blocks
from tasks.training.compiled_blocks import compile_blocks, compile_errors, matmul_path
from tasks.training.train_key import inputs
from tasks.training.train_setup import prepare_denoiser
from support import a_plan

MODEL = ModelConfig(path=None, seed=0, arch={}, dtype="float32", max_sequence_length=32, storage_dtype=None,
                    storage_modulation=False, quantize="none", matmul="auto")


def _adapter(family: str, root: Path):
    model = replace(MODEL, family=family)
    return make_adapter(model, resolve_model(model, Store(root))), model


def _step(adapter, denoiser, named):
    """One step's loss and LoRA gradients on two 64 px images, with fixed draws."""
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = adapter.encode_latents(adapter.load_vae(), pixels)
    text = {k: v[None].repeat(2, *[1] * v.dim())
            for k, v in adapter.encode_text(adapter.load_text_encoders(), ["a red circle"])[0].items()}
    cfg = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, guidance=1.0)
    loss = adapter.training_loss(denoiser, latents, text, cfg, adapter.load_train_scheduler(),
                                 [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in named.items()}


@pytest.mark.parametrize("model_extra,train_extra", [
    ({}, {}),
    # torchao's int8 weights and a swapped block run eagerly inside the compiled blocks (fp8_base._eager_linear)
    ({"quantize": "int8", "matmul": "w8a8"}, {"blocks_to_swap": 1}),
    ({"quantize": "nf4"}, {}),
    ({"quantize": "nf4", "matmul": "bnb"}, {})])  # bitsandbytes' NF4 (nf4_kernel.py), eager inside the blocks too
def test_a_compiled_step_equals_eager_within_fp32_rounding(tmp_path, model_extra, train_extra):
    adapter, model = _adapter("flux", tmp_path)
    model = replace(model, **model_extra)
    cfg = config_of({"model": model, "train": {"rank": 4, "alpha": None, "target_modules": None,
                                               "gradient_checkpointing": True, **train_extra}})
    torch.manual_seed(0)
    eager, eager_lora = prepare_denoiser(adapter, cfg)
    torch.manual_seed(0)
    compiled, compiled_lora = prepare_denoiser(adapter, cfg)
    blocks = len(compiled.transformer_blocks) + len(compiled.single_transformer_blocks)
    assert compile_blocks(compiled, adapter.swap_blocks) == blocks  # diffusers' _repeated_blocks: every block
    eager.train(), compiled.train()
    loss_e, grads_e = _step(adapter, eager, eager_lora)
    loss_c, grads_c = _step(adapter, compiled, compiled_lora)
    # Inductor fuses and reorders fp32 sums. Rounding error of a reordered sum of K terms is at most K x eps x
    # the sum of their magnitudes (Higham's gamma_K); the longest reductions here are K <= 64 (width, tokens,
    # batch x tokens), chained through about 10 layers: 10 x 64 x 2^-23 = 7.6e-5 of the largest magnitude.
    bound = 10 * 64 * torch.finfo(torch.float32).eps
    assert abs(loss_c - loss_e) <= bound * abs(loss_e)
    scale = max(g.abs().max() for g in grads_e.values())
    assert grads_c.keys() == grads_e.keys()
    assert all((grads_c[k] - grads_e[k]).abs().max() <= bound * scale for k in grads_e)


def test_blocks_without_diffusers_list_are_compiled_from_the_family_declaration(tmp_path):
    adapter, _ = _adapter("sd3", tmp_path)  # SD3Transformer2DModel declares no _repeated_blocks
    denoiser = adapter.load_denoiser()
    assert not getattr(denoiser, "_repeated_blocks", None)
    assert compile_blocks(denoiser, adapter.swap_blocks) == len(denoiser.transformer_blocks)


def test_the_setting_enters_the_key_only_when_on():
    from tasks.config import compose, resolve_paths

    plan = a_plan(family="flux", ids={"denoiser": "d", "scheduler": "s"})
    off = inputs(resolve_paths(compose("train", [])[0]), plan, {}, {})
    on = inputs(resolve_paths(compose("train", ["train.compile=true"])[0]), plan, {}, {})
    # at its default the setting is left out, so every earlier LoRA keeps its key
    assert "compile" not in json.dumps(off, default=str) and "compile" in json.dumps(on, default=str)


def test_a_machine_without_a_compiler_is_told_in_one_line(monkeypatch):
    monkeypatch.setattr(compiled_blocks.shutil, "which", lambda name: None)
    (msg,) = compile_errors(TrainConfig(compile=True), cuda=False)
    assert "train.compile=true" in msg and "C++ compiler" in msg and "\n" not in msg
    assert compile_errors(TrainConfig(compile=False), cuda=False) == []


def test_the_report_names_the_kernel_paths():
    assert matmul_path(None, "bfloat16") == "bfloat16 matmul"
    assert "torchao dequantize" in matmul_path("nf4", "bfloat16") and "fallback" in matmul_path("nf4", "bfloat16")
    assert "cast to bfloat16" in matmul_path("float8_e4m3fn", "bfloat16")
    assert "bnb-nf4" in matmul_path("nf4", "bfloat16", "bnb") and "fallback" not in matmul_path("nf4", "bfloat16", "bnb")
