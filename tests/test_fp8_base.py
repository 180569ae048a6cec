"""The fp8 base in training (tasks/training/fp8_base.py): gradients equal those through an upcast copy of the same
fp8 weights, only fp8 weights are saved for backward (never a bf16 copy of a base weight), no fp8
embedding lookup, and every family trains with it through the CLI."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers.hooks import apply_layerwise_casting

from tasks.config import updated
from tasks.training.fp8_base import store_base_low
from tasks.models import make_adapter, resolve_model
from tasks.store import Store
from tasks.training.train_setup import prepare_denoiser
from support import REPO
from families import image_families
from support import assert_same_step, family_sweep, run_cli
from support import BF16, generator, one_image_inputs, one_step_loss, tiny_family  # noqa: F401 (shared helpers, tests/support.py)

FP8 = torch.float8_e4m3fn
FAMILIES = image_families()  # every text-to-image family of the registry


@pytest.mark.parametrize("layer", [
    lambda: torch.nn.Linear(24, 40),
    lambda: torch.nn.Linear(24, 40, bias=False),
    lambda: torch.nn.Conv2d(6, 10, 3, padding=1),
    lambda: torch.nn.Conv2d(6, 12, 3, stride=2, padding=1, groups=2),
    lambda: torch.nn.Conv2d(6, 10, 3, padding=1, padding_mode="reflect"),
    lambda: torch.nn.Conv1d(6, 10, 3, padding=2, dilation=2),
], ids=["linear", "linear-nobias", "conv", "conv-strided-grouped", "conv-reflect", "conv1d-dilated"])
@pytest.mark.numerics
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32-autocast-bf16"])
def test_one_layer_equals_its_upcast_copy(layer, autocast):
    torch.manual_seed(0)
    reference = layer().to(BF16).requires_grad_(False)
    low = copy.deepcopy(reference)
    assert store_base_low(torch.nn.Sequential(low), FP8, BF16, ()) == ["0"]
    assert low.weight.dtype == FP8
    reference.weight.data = low.weight.data.to(BF16)  # the same fp8 values, upcast once, held in bf16

    shape = (2, 24) if isinstance(reference, torch.nn.Linear) else (2, 6, 9, 9)[: reference.weight.dim()]
    x_dtype = torch.float32 if autocast else BF16
    x = torch.randn(shape, generator=generator(), dtype=x_dtype)
    outputs, grads = [], []
    for module in (reference, low):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            y = module(xi)
        y.float().pow(2).sum().backward()
        outputs.append(y)
        grads.append(xi.grad)
    assert outputs[0].dtype == outputs[1].dtype and grads[1].dtype == x_dtype
    # the same bf16 values through the same kernels: the same bits (an fp8 weight is upcast exactly)
    assert torch.equal(outputs[1], outputs[0])
    assert torch.equal(grads[1], grads[0])


@pytest.mark.numerics
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_through_the_fp8_base_equal_an_upcast_copy(family, tmp_path):
    """Input and LoRA gradients, through the whole denoiser: the fp8 base against a plain bf16 denoiser
    holding the fp8 weights upcast (same LoRA initial weights); the losses are equal too."""
    adapter, cfg = tiny_family(family, tmp_path, "float8_e4m3fn")
    torch.manual_seed(0)  # the LoRA's initial weights, as the train node seeds them
    low, low_lora = prepare_denoiser(adapter, cfg)
    torch.manual_seed(0)
    ref, ref_lora = prepare_denoiser(adapter, updated(cfg, {"model.storage_dtype": None}))
    low_params = dict(low.named_parameters())
    stored = [n for n, p in low_params.items() if p.dtype == FP8]
    assert stored and any("conv" in n for n in stored) == (family in ("sdxl", "sd15"))
    for name, p in ref.named_parameters():
        if low_params[name].dtype == FP8:
            p.data = low_params[name].data.to(BF16)
    for name in ref_lora:
        assert torch.equal(ref_lora[name], low_lora[name]), name  # same start

    # every layer sees the same bf16 weights (upcast from fp8 on the fly, or held upcast) and runs the same
    # kernels: loss and gradients are the same bits, on the AVX2 kernels and the machine's own
    assert_same_step(adapter, (ref, ref_lora), (low, low_lora))


def _saved_for_backward(block, run):
    """(dtype, shape, bytes) of every tensor autograd saves while `run(block)` goes forward."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape), t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(block)
    out.float().pow(2).mean().backward()
    return saved


def _flux_block(tmp_path, storage):
    adapter, cfg = tiny_family("flux", tmp_path, storage)
    denoiser, lora = prepare_denoiser(adapter, cfg)
    block = denoiser.transformer_blocks[0]
    width = block.norm1.linear.in_features
    g = generator(1)
    hidden, context, temb = (torch.randn(1, 40, width, generator=g, dtype=BF16),
                             torch.randn(1, 24, width, generator=g, dtype=BF16),
                             torch.randn(1, width, generator=g, dtype=BF16))

    def run(b):
        h = hidden.clone().requires_grad_(True)
        c, out = b(hidden_states=h, encoder_hidden_states=context, temb=temb)
        return out.sum() + c.sum()

    return block, run


def _base_weights(block):
    return [p for n, p in block.named_parameters() if "lora_" not in n and p.dim() >= 2]


def test_only_fp8_weights_are_saved_for_backward(tmp_path):
    """One Flux double-stream block with LoRA: no compute-dtype (bf16) copy of any base weight is among the
    tensors saved for backward; each stored-low weight is saved as its fp8 bytes. The same count on diffusers'
    layerwise casting (the previous fp8 base) finds the bf16 copies, so this check can fail."""
    block, run = _flux_block(tmp_path, "float8_e4m3fn")
    weights = _base_weights(block)
    low = {tuple(p.shape) for p in weights if p.dtype == FP8}
    assert low
    saved = _saved_for_backward(block, run)
    copies = [s for s in saved if s[0] == BF16 and s[1] in low]
    assert copies == []
    # what is saved of the base: whole fp8 weights, at most once each (a layer whose input needs no gradient,
    # the modulation fed by temb here, saves nothing)
    fp8_saved = [(shape, b) for d, shape, b in saved if d == FP8]
    assert fp8_saved and all(shape in low for shape, _ in fp8_saved)
    assert 0 < sum(b for _, b in fp8_saved) <= sum(p.numel() for p in weights if p.dtype == FP8)

    # diffusers' layerwise casting, applied as the previous code did (before peft): bf16 weights saved
    adapter, cfg = tiny_family("flux", tmp_path / "lc")
    denoiser = adapter.load_denoiser().requires_grad_(False)
    from tasks.training.memory import layerwise_skip_patterns
    apply_layerwise_casting(denoiser, storage_dtype=FP8, compute_dtype=BF16,
                            skip_modules_pattern=layerwise_skip_patterns(type(denoiser)))
    _, run_lc = _flux_block(tmp_path / "plain", None)
    saved_lc = _saved_for_backward(denoiser.transformer_blocks[0], run_lc)
    assert [s for s in saved_lc if s[0] == BF16 and s[1] in low]


@pytest.fixture(scope="module")
def fp8_sweep(tmp_path_factory):
    return family_sweep(tmp_path_factory.mktemp("fp8-cli"), "model.storage_dtype=float8_e4m3fn")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_on_an_fp8_base_through_the_cli(family, fp8_sweep):
    proc, sweep = fp8_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    member = sweep / str(FAMILIES.index(family))
    assert (member / ".hydra" / "overrides.yaml").read_text().count(f"model=tiny_{family}\n") == 1
    report = json.loads((member / "report.json").read_text())
    assert set(report["nodes"]) == {"caption", "validate", "cache_latents", "cache_text", "train", "sample"}
    assert report["nodes"]["train"]["status"] == "ran" and len(report["loss"]) == 2
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in report["loss"])
    assert Path(report["artifacts"]["lora"]).is_file()
    assert len(report["artifacts"]["samples"]) == 3 and all(Path(p).is_file() for p in report["artifacts"]["samples"])
