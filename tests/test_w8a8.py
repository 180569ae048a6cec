"""Issue 45 item 1: model.matmul=w8a8 (tasks/training/w8a8.py), the frozen base's matmuls in the stored type with
per-token activations, forward and input gradient. On the CPU the same kernels run (torchao's safe_int_mm: an exact
int32 matmul; torch._scaled_mm's CPU kernel), so the numbers are checked here; the speed is bench/'s on a GPU.

Every bound is derived: int8 products are exact integers, so the kernel's result equals the test's own reference
up to fp32 rounding of the scaling (a few 2^-24 relative); against the dequantized (fallback) matmul the difference
is the activations' rounding, at most half a quantization step per element times the weights' absolute sum."""
from __future__ import annotations

import pytest
import torch
from torchao.quantization import Int8Tensor, PerRow

from tasks.config import compose, resolve_paths
from tasks.training import w8a8
from tasks.training.fp8_base import _LinearFromStorage
from tasks.validate import config_errors

F32_EPS = 2.0 ** -24  # unit roundoff of float32


def _inputs(seed=0, m=24, k=64, n=48):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 3.0, m)[:, None]  # tokens of different magnitudes
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return x, w, torch.randn(n, generator=g) * 0.1


def _int8(w):
    return Int8Tensor.from_hp(w, PerRow())


def test_int8_forward_is_the_integer_product_scaled():
    x, w, b = _inputs()
    q = _int8(w)
    y = w8a8.int8_linear(x, q, b)
    sx = x.abs().amax(-1, keepdim=True) / 127
    xq = (x / sx).round().clamp(-128, 127)
    exact = (xq.double() @ q.qdata.double().t()) * sx.double() * q.scale.double().view(1, -1) + b.double()
    # int32 accumulation is exact (|sum| <= 64 * 128 * 127 < 2^31); then two fp32 products and a sum
    assert torch.allclose(y.double(), exact, rtol=8 * F32_EPS, atol=8 * F32_EPS * exact.abs().max().item())
    deq = x.double() @ q.dequantize(torch.float32).double().t() + b.double()
    bound = 0.5 * sx.double() * q.dequantize(torch.float32).double().abs().sum(1)[None, :]  # half a step per token
    assert ((y.double() - deq).abs() <= bound * (1 + 1e-6)).all()
    assert (y.double() - deq).abs().max() > 0  # the activations were rounded: another matmul than the fallback


def test_int8_input_gradient():
    x, w, _ = _inputs(1)
    q = _int8(w)
    g = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(2))
    out = w8a8.int8_grad_input(g, q, torch.float32)
    wd = q.dequantize(torch.float32).double()
    scaled = g.double() * q.scale.double().view(1, -1)
    sg = scaled.abs().amax(-1, keepdim=True) / 127
    bound = 0.5 * sg * q.qdata.double().abs().sum(0)[None, :]
    assert ((out.double() - g.double() @ wd).abs() <= bound * (1 + 1e-6) + 8 * F32_EPS).all()


def test_fp8_forward_and_input_gradient_within_the_rounding_of_e4m3_and_e5m2():
    x, w, b = _inputs(3)
    w8 = w.to(torch.float8_e4m3fn)
    wd = w8.double()
    y = w8a8.fp8_linear(x, w8, b)
    sx = x.abs().amax(-1, keepdim=True).double() / 448
    # e4m3: 3 mantissa bits, half a step = 2^-4 of the value; below 2^-6 (subnormal) half of 2^-9 absolute
    step = torch.maximum(x.abs().double() * 2 ** -4, sx * 2 ** -10)
    ref = x.double() @ wd.t() + b.double()
    bound = step @ wd.abs().t() + 2 ** -8 * ref.abs()  # plus the bf16 output's rounding
    assert ((y.double() - ref).abs() <= bound + 1e-6).all()
    g = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(4))
    gx = w8a8.fp8_grad_input(g, w8, torch.float32)
    sg = g.abs().amax(-1, keepdim=True).double() / 57344
    step = torch.maximum(g.abs().double() * 2 ** -3, sg * 2 ** -17)  # e5m2: 2 mantissa bits; min subnormal 2^-16
    ref = g.double() @ wd
    assert ((gx.double() - ref).abs() <= step @ wd.abs() + 2 ** -8 * ref.abs() + 1e-6).all()


@pytest.mark.parametrize("m", [5, 16, 17, 40])
def test_int8_mm_operands_for_cuda_keep_the_product(m):
    """CUDA's torch._int_mm gets the weight column-major and at least 17 rows (w8a8._cuda_operands); the product
    of those operands, rows cut back, is the same integers (checked in float64: |sum| <= 64 * 128 * 128 < 2^53).
    The CPU's kernel (safe_int_mm) is exact in either layout."""
    from torchao.kernel.intmm import safe_int_mm

    g = torch.Generator().manual_seed(m)
    a = torch.randint(-128, 128, (m, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (48, 64), generator=g, dtype=torch.int8)
    gq = torch.randint(-128, 128, (m, 48), generator=g, dtype=torch.int8)
    for lhs, b, exact in ((a, w.t(), a.double() @ w.double().t()), (a, w.t().contiguous(), a.double() @ w.double().t()),
                          (gq, w, gq.double() @ w.double())):
        pa, pb = w8a8._cuda_operands(lhs, b)
        assert pb.stride(0) == 1 and pa.shape[0] == max(m, 17) and pa.is_contiguous()
        assert torch.equal((pa.double() @ pb.double())[:m], exact)
        assert torch.equal(w8a8._int8_mm(lhs, b), exact.to(torch.int32))
        assert torch.equal(safe_int_mm(lhs, b), exact.to(torch.int32))


def test_the_quantization_compiled_as_on_cuda_gives_the_eager_numbers():
    """On CUDA the passes around the matmul run through torch.compile (w8a8._fused); here Inductor's CPU backend
    compiles the same functions. Scales: one fp32 division each way, equal. The int8 values: equal but where
    x / scale lands within an fp32 rounding of a .5 boundary (a kernel may divide as a multiply by the
    reciprocal): at most 1 apart."""
    x, w, b = _inputs(6)
    q, s = w8a8._compiled(w8a8._to_int8)(x)
    qe, se = w8a8._to_int8(x)
    assert torch.allclose(s, se, rtol=2 * F32_EPS, atol=0) and (q.int() - qe.int()).abs().max() <= 1
    acc = torch.randint(-2 ** 20, 2 ** 20, (x.shape[0], w.shape[0]), dtype=torch.int32)
    y = w8a8._compiled(w8a8._int8_out)(acc, s, w.abs().amax(1), b, torch.float32)
    ye = w8a8._int8_out(acc, s, w.abs().amax(1), b, torch.float32)
    # two fp32 products and a sum, in any order: a few units of fp32 rounding of the result's magnitude
    assert torch.allclose(y, ye, rtol=4 * F32_EPS, atol=4 * F32_EPS * ye.abs().max().item())


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_autograd_function_takes_the_kernels_only_when_asked_and_only_where_shapes_fit(kind):
    x, w, b = _inputs(5)
    stored = _int8(w) if kind == "int8" else w.to(torch.float8_e4m3fn)
    outs = {}
    for on in (False, True):
        xi = x.clone().requires_grad_(True)
        y = _LinearFromStorage.apply(xi, stored, b, torch.float32, on)
        y.square().sum().backward()
        outs[on] = (y.detach(), xi.grad)
    kernel = (w8a8.linear(x, stored, b), None)
    assert torch.equal(outs[True][0], kernel[0]) and not torch.equal(outs[False][0], outs[True][0])
    odd = torch.randn(8, 40)  # 40 is no multiple of 16: the fallback, whatever the mode
    stored_odd = _int8(torch.randn(24, 40)) if kind == "int8" else torch.randn(24, 40).to(torch.float8_e4m3fn)
    assert torch.equal(_LinearFromStorage.apply(odd, stored_odd, None, torch.float32, True),
                       _LinearFromStorage.apply(odd, stored_odd, None, torch.float32, False))


def _cfg(tmp_path, *extra):
    from pathlib import Path

    demo = Path(__file__).resolve().parents[1] / "data" / "demo"
    return resolve_paths(compose("train", [f"data.dir={demo}", f"store.root={tmp_path / 'store'}", "data.resolution=32",
                                           "train.max_steps=3", "train.batch_size=2", "train.log_with=none",
                                           "sample.every_n_steps=0", *extra])[0])


def test_auto_is_the_fallback_on_the_cpu_and_keys_stay(tmp_path):
    from tasks.training.train_key import _modulation

    auto, deq, on = (_cfg(tmp_path, "model.quantize=int8", f"model.matmul={m}") for m in ("auto", "dequantize", "w8a8"))
    assert w8a8.resolve(auto.model) == "dequantize" and w8a8.resolve(on.model) == "w8a8"
    assert _modulation(auto) == _modulation(deq) == {"fp8_base": "autograd-cast-1", "quantize": "int8"}
    assert _modulation(on)["matmul"] == "w8a8"
    assert w8a8.resolve(_cfg(tmp_path, "model.quantize=nf4").model) == "dequantize"
    assert w8a8.resolve(_cfg(tmp_path, "model.storage_dtype=float8_e4m3fn", "model.matmul=w8a8").model) == "w8a8"


def test_refusals_name_the_key(tmp_path):
    errors = config_errors(_cfg(tmp_path, "model.quantize=nf4", "model.matmul=w8a8"))
    assert any("model.matmul=w8a8" in e and "nf4" in e for e in errors)
    assert any("model.matmul='fast'" in e for e in config_errors(_cfg(tmp_path, "model.matmul=fast")))


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
def test_a_run_trains_through_the_kernels_and_the_report_names_them(tmp_path, quantize):
    from tasks import cache_latents, cache_text, train, validate
    from tasks.store import Store

    cfg = _cfg(tmp_path, f"model.quantize={quantize}", "model.dtype=bfloat16", "model.matmul=w8a8")
    store = Store(cfg.store.root)
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    calls = []
    real = w8a8.linear
    w8a8.linear = lambda *a: calls.append(1) or real(*a)
    try:
        out = train.run(cfg, plan, store, lat["items"], txt["items"])
    finally:
        w8a8.linear = real
    assert calls and out["losses"] and all(torch.isfinite(torch.tensor([r["loss"] for r in out["losses"]])))
    assert "w8a8" in out["runtime"]["matmul"]  # report.json's runtime.matmul


def test_auto_keeps_the_fallback_where_a_gpu_has_the_kernels(tmp_path, monkeypatch):
    """auto is the path measured faster on an H200 (bench/gpu_speed_fallback.json): the fallback for fp8 / int8
    bases even where the kernels run; w8a8 when asked."""
    monkeypatch.setattr(w8a8, "cuda_available", lambda: True)
    monkeypatch.setattr(w8a8, "available", lambda kind: True)
    for q in ("int8", "fp8"):
        assert w8a8.resolve(_cfg(tmp_path, f"model.quantize={q}").model) == "dequantize"
        assert w8a8.resolve(_cfg(tmp_path, f"model.quantize={q}", "model.matmul=w8a8").model) == "w8a8"


def test_fp8_w8a8_on_a_gpu_without_the_fp8_kernel_is_refused_naming_the_fix(tmp_path, monkeypatch):
    import tasks.config_checks as checks

    monkeypatch.setattr(checks, "cuda_available", lambda: True)
    monkeypatch.setattr(w8a8, "available", lambda kind: kind == "int8")  # an Ampere card: int8 yes, fp8 no
    errors = config_errors(_cfg(tmp_path, "model.quantize=fp8", "model.matmul=w8a8"))
    assert any("model.matmul=w8a8" in e and "8.9" in e and "model.matmul=dequantize" in e for e in errors)
    assert not any("model.matmul" in e for e in config_errors(_cfg(tmp_path, "model.quantize=int8",
                                                                   "model.matmul=w8a8")))


def test_torchao_no_triton_warning_is_silenced_and_only_it():
    """Importing torchao on a machine without triton warned on every run (issue 62); other lines of its
    logger still print."""
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import logging; logging.basicConfig(); import tasks, torchao.quantization; "
             "logging.getLogger('torchao.kernel.intmm').warning('another line')")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Detected no triton" not in proc.stderr and "another line" in proc.stderr, proc.stderr
