"""Issue 45 item 1, nf4: model.matmul=bnb (tasks/training/nf4_kernel.py), an NF4 base in bitsandbytes' format
multiplied by `bnb.matmul_4bit`. bitsandbytes 0.50's CPU backend runs it (its C dequantize, then the matmul), so
the real library's path is what runs here; the GPU's speed is bench.gpu_speed's `nf4+bnb` row.

Bounds, derived (u = 2^-8, bf16's unit roundoff; K the inner dimension): a bf16 matmul with fp32 accumulation
differs from the exact product of its bf16 operands by at most (u + K 2^-24) |x| @ |W|^T (the fp32 sum's error,
then one rounding to bf16). An NF4 weight is within half the widest gap g of the code book times its block's
absmax a, plus the error d of the second level's scale, plus its own rounding to bf16: |W - w| <= a g / 2 + d +
u |W|. d: bnb's second level is an 8-bit dynamic code over absmax - mean in blocks of 256 (its error at most the
code's widest gap times that block's largest |absmax - mean|, <= A the weight's largest absmax); torchao's a
symmetric int8 of the same (one step, A / 128, at its clamp, plus its bf16 roundings: 2 u A)."""
from __future__ import annotations

import sys

import pytest
import torch

from tasks.config import ConfigError, compose, resolve_paths, updated
from tasks.training import w8a8
from tasks.training.fp8_base import _LinearFromStorage, upcast
from tasks.training.quantized_base import quantize_base, quantize_weight
from tasks.validate import config_errors
from families import image_families
from support import BF16, assert_same_step, generator, tiny_family

bnb = pytest.importorskip("bitsandbytes")  # a pinned dependency (constraints.txt): present wherever make test ran
from tasks.training.nf4_kernel import BLOCK, BnbNF4  # noqa: E402 -- after the skip

U, F32_EPS = 2.0 ** -8, 2.0 ** -24


def _weight(seed=0, n=96, k=128):
    return (torch.randn(n, k, generator=generator(seed)) / k ** 0.5).to(BF16)


def _max_gap(code: torch.Tensor) -> float:
    return float(code.float().sort().values.diff().max())


def _matmul_tol(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a @ b computed in bf16 with fp32 accumulation - the exact product| <= this (the module doc)."""
    return (U + a.shape[-1] * F32_EPS) * (a.double().abs() @ b.double().abs())


def test_the_stored_weight_is_bnbs_nf4_and_a_valid_quantization():
    w = _weight()
    q = quantize_weight(w, "nf4", "bnb")
    assert isinstance(q, BnbNF4) and q.shape == w.shape and q.dtype == BF16
    # bnb's own quantize_4bit with QLoRA's settings, bit for bit
    packed, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(q.packed, packed) and torch.equal(q.dequantize(), bnb.functional.dequantize_4bit(packed, state))
    ao = quantize_weight(w, "nf4")  # torchao's NF4, the fallback: the same NormalFloat code book (its in bf16)
    assert ((ao.nf4.float() - q.code.float()).abs() <= U * q.code.float().abs()).all()
    blocks = w.float().reshape(-1, BLOCK)
    a = blocks.abs().amax(1, keepdim=True)
    g, big = _max_gap(q.code), a.max()
    for stored, d in ((q.dequantize(torch.float32), big * _max_gap(q.nested_code)),
                      (ao.get_original_weight().float(), big * (1 / 128 + 2 * U))):
        err = (stored.reshape(-1, BLOCK) - blocks).abs()
        # + 2 u a: torchao picks the code from w / a rounded to bf16 and decodes with a bf16 code book
        assert (err <= a * (g / 2 + 2 * U) + d + U * stored.reshape(-1, BLOCK).abs()).all()
    # the same layers, other numbers: bnb's second level is not torchao's (hence model.matmul=bnb in the key)
    assert not torch.equal(q.dequantize(), ao.get_original_weight())
    assert quantize_weight(torch.randn(3, 30), "nf4", "bnb") is None  # NF4's block, as torchao's path keeps them
    moved = torch.nn.Parameter(q.to("cpu"), requires_grad=False)
    assert type(moved) is BnbNF4 and torch.equal(moved.dequantize(), q.dequantize()) and not moved.is_pinned()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_forward_and_input_gradient_are_bnbs_matmul_4bit(bias, autocast):
    """The Function's bnb path against bnb's own autograd (MatMul4Bit) and against the dequantize path over the
    same stored weight: within the bf16 matmul bound, and on the CPU the same bits (bnb's CPU gemm_4bit is its
    dequantize_4bit then F.linear)."""
    w = _weight(1)
    q = quantize_weight(w, "nf4", "bnb")
    b = torch.randn(w.shape[0], generator=generator(2)).to(BF16) if bias else None
    x = torch.randn(5, 7, w.shape[1], generator=generator(3))
    x = x if autocast else x.to(BF16)  # under autocast an fp32 input, as accelerate's bf16 runs pass it
    g = torch.randn(5, 7, w.shape[0], generator=generator(4)).to(BF16)
    outs = {}
    for path in ("ours", "bnb", "dequantize"):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            if path == "ours":
                y = _LinearFromStorage.apply(xi, q, b, BF16, False)
            elif path == "bnb":
                y = bnb.matmul_4bit(xi.to(BF16), q.packed, q.quant_state(), bias=b)
            else:
                y = torch.nn.functional.linear(xi.to(BF16), upcast(q, BF16), b)
        y.backward(g)  # outside autocast, as accelerate's backward
        outs[path] = (y, xi.grad)
    wd = q.dequantize(torch.float64)
    exact = x.to(BF16).double() @ wd.t() + (b.double() if bias else 0)
    assert (outs["ours"][0].double() - exact).abs().le(_matmul_tol(x.to(BF16), wd.t()) + U * exact.abs()).all()
    assert (outs["ours"][1].double() - g.double() @ wd).abs().le(_matmul_tol(g, wd)).all()
    for other in ("bnb", "dequantize"):
        assert outs["ours"][0].dtype == outs[other][0].dtype == BF16
        assert torch.equal(outs["ours"][0], outs[other][0]) and torch.equal(outs["ours"][1], outs[other][1]), other


def test_the_kernel_path_against_torchaos_dequantize_path():
    """bnb's NF4 through matmul_4bit against torchao's NF4 dequantized (what model.matmul=dequantize runs) for the
    same bf16 weight: each is the matmul of its own quantized weight within the bf16 bound, so they differ by at
    most |x| @ |W_bnb - W_torchao|^T plus both bounds (and the weights by the quantization bound above)."""
    w = _weight(5)
    q, ao = quantize_weight(w, "nf4", "bnb"), quantize_weight(w, "nf4")
    x = torch.randn(6, w.shape[1], generator=generator(6)).to(BF16)
    g = torch.randn(6, w.shape[0], generator=generator(7)).to(BF16)
    res = {}
    for name, stored in (("bnb", q), ("torchao", ao)):
        xi = x.clone().requires_grad_(True)
        y = _LinearFromStorage.apply(xi, stored, None, BF16, False)
        y.backward(g)
        res[name] = (y.double(), xi.grad.double(), upcast(stored, BF16).double())
    (y1, gx1, w1), (y2, gx2, w2) = res["bnb"], res["torchao"]
    diff = (w1 - w2).abs()
    assert ((y1 - y2).abs() <= x.double().abs() @ diff.t() + _matmul_tol(x, w1.t()) + _matmul_tol(x, w2.t())).all()
    assert ((gx1 - gx2).abs() <= g.double().abs() @ diff + _matmul_tol(g, w1) + _matmul_tol(g, w2)).all()
    assert (y1 - y2).abs().max() > 0  # other numbers, as the key says


@pytest.mark.numerics
@pytest.mark.parametrize("family", image_families())
def test_gradients_through_a_bnb_base_equal_a_bf16_copy_of_it(family, tmp_path):
    """A whole denoiser on model.matmul=bnb against a plain bf16 one holding bnb's weights dequantized: the same
    loss, input and LoRA gradients, bit for bit on the CPU, for every family."""
    adapter, cfg = tiny_family(family, tmp_path)
    from tasks.training.train_setup import prepare_denoiser

    qcfg = updated(cfg, {"model.quantize": "nf4", "model.matmul": "bnb"})
    torch.manual_seed(0)
    low, low_lora = prepare_denoiser(adapter, qcfg)
    torch.manual_seed(0)
    ref, ref_lora = prepare_denoiser(adapter, cfg)
    low_params = dict(low.named_parameters())
    stored = [n for n, p in low_params.items() if type(p) is BnbNF4]
    assert stored, "nothing stored in bnb's format"
    for name, p in ref.named_parameters():
        if name in stored:
            p.data = upcast(low_params[name], BF16)
    assert_same_step(adapter, (ref, ref_lora), (low, low_lora))


def _cfg(tmp_path, *extra):
    from pathlib import Path

    demo = Path(__file__).resolve().parents[1] / "data" / "demo"
    return resolve_paths(compose("train", [f"data.dir={demo}", f"store.root={tmp_path / 'store'}", "data.resolution=32",
                                           "train.max_steps=3", "train.batch_size=2", "train.log_with=none",
                                           "sample.every_n_steps=0", *extra])[0])


def test_selection_keys_and_refusals(tmp_path, monkeypatch):
    from tasks.training.train_key import _modulation

    auto, deq, on = (_cfg(tmp_path, "model.quantize=nf4", f"model.matmul={m}") for m in ("auto", "dequantize", "bnb"))
    # auto takes the kernel on a CUDA GPU with bnb's CUDA library; on the CPU the fallback, keys as they were
    assert w8a8.bnb_kernel() or not torch.cuda.is_available()
    assert w8a8.resolve(auto.model) == ("bnb" if w8a8.bnb_kernel() else "dequantize")
    assert w8a8.resolve(deq.model) == "dequantize" and w8a8.resolve(on.model) == "bnb"
    assert "matmul" not in _modulation(deq) and _modulation(on)["matmul"] == "bnb"
    if not w8a8.bnb_kernel():
        assert _modulation(auto) == _modulation(deq)
    assert not config_errors(on)
    assert any("model.matmul=bnb multiplies an nf4 base" in e and "model.quantize=nf4" in e
               for e in config_errors(_cfg(tmp_path, "model.quantize=int8", "model.matmul=bnb")))
    assert any("model.matmul=w8a8" in e and "model.matmul=bnb" in e
               for e in config_errors(_cfg(tmp_path, "model.quantize=nf4", "model.matmul=w8a8")))
    # a machine without bitsandbytes (its import made to fail, as an absent package's does): refused with the fix
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    w8a8.bnb_kernel.cache_clear()
    assert not w8a8.bnb_importable() and w8a8.resolve(auto.model) == "dequantize"
    errors = config_errors(on)
    assert any("model.matmul=bnb needs bitsandbytes" in e and "model.matmul=dequantize" in e for e in errors), errors
    with pytest.raises(ConfigError, match="model.matmul=bnb needs bitsandbytes"):
        quantize_weight(_weight(), "nf4", "bnb")
    monkeypatch.undo()
    w8a8.bnb_kernel.cache_clear()


def test_the_cli_refuses_bnb_without_bitsandbytes_in_one_line_and_exits_2(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    run = ("import sys, runpy; sys.modules['bitsandbytes'] = None; "  # a machine without it: its import fails
           "sys.argv = ['flows.train', *sys.argv[1:]]; runpy.run_module('flows.train', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", run, "model.quantize=nf4", "model.matmul=bnb",
                           f"store.root={tmp_path / 'store'}", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert out.count("model.matmul=bnb needs bitsandbytes") == 1 and "model.matmul=dequantize" in out, out


def _train(cfg):
    from tasks import cache_latents, cache_text, train, validate
    from tasks.store import Store

    store = Store(cfg.store.root)
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    out = train.run(cfg, plan, store, lat["items"], txt["items"])
    return out, open(out["lora"], "rb").read()


def test_a_run_trains_through_bnb_reports_it_and_is_deterministic(tmp_path):
    """The train node on model.matmul=bnb (streamed in: base_loading stores each weight in bnb's format as it is
    read): report.json's runtime.matmul names the path, the same config gives the same LoRA bytes, swapping
    blocks changes nothing (on the CPU), and the fallback gives another LoRA under another key."""
    args = ("model.quantize=nf4", "model.dtype=bfloat16")
    first, a = _train(_cfg(tmp_path / "a", *args, "model.matmul=bnb"))
    assert all(torch.isfinite(torch.tensor([r["loss"] for r in first["losses"]])))
    assert "bnb-nf4" in first["runtime"]["matmul"] and "bnb.matmul_4bit" in first["runtime"]["matmul"]
    again, b = _train(_cfg(tmp_path / "b", *args, "model.matmul=bnb"))
    swapped, c = _train(_cfg(tmp_path / "c", *args, "model.matmul=bnb", "train.blocks_to_swap=2"))
    assert a == b == c and first["key"] == again["key"] == swapped["key"]
    fallback, d = _train(_cfg(tmp_path / "d", *args, "model.matmul=dequantize"))
    assert "torchao dequantize" in fallback["runtime"]["matmul"]
    assert d != a and fallback["key"] != first["key"]


def test_streamed_bnb_weights_equal_the_loaded_then_quantized_ones(tmp_path):
    """base_loading's streamed path stores bnb's NF4 as it reads each weight; from_pretrained-then-quantize_base
    gives the same bytes (the same bf16 values through the same quantize_4bit)."""
    from tasks.training.train_setup import prepare_denoiser

    adapter, cfg = tiny_family("flux", tmp_path)
    qcfg = updated(cfg, {"model.quantize": "nf4", "model.matmul": "bnb"})
    made = []
    for stream in (True, False):
        torch.manual_seed(0)
        made.append(dict(prepare_denoiser(adapter, qcfg, stream=stream)[0].named_parameters()))
    streamed, loaded = made
    assert streamed.keys() == loaded.keys()
    n = 0
    for name, p in streamed.items():
        other = loaded[name]
        assert type(p) is type(other), name
        if type(p) is BnbNF4:
            names, attrs = p.__tensor_flatten__()
            assert attrs == other.__tensor_flatten__()[1]
            assert all(torch.equal(getattr(p, k), getattr(other, k)) for k in names), name
            n += 1
        else:
            assert torch.equal(p, other), name
    assert n


def test_quantize_base_keeps_what_nf4_cannot_hold_and_stores_the_rest_in_bnbs_format():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(30, 6)).to(BF16).requires_grad_(False)
    assert quantize_base(model, "nf4", BF16, (), "bnb") == {"quantized": ["0"], "kept": ["1"]}
    assert type(model[0].weight) is BnbNF4 and model[1].weight.dtype == BF16
