"""Where model.matmul=w8a8's time goes: one frozen Linear at FLUX.1-dev's shapes, per kernel layout and with the
per-token quantization around it, forward (x @ W^T) and input gradient (g @ W), against bf16. Issue 45.

    python -m bench.gpu_matmul            # a CUDA GPU (bench/gpu_matmul.json)
    python -m bench.gpu_matmul --tiny     # smoke test on any machine (small shapes; a kernel it lacks: an error row)

Each row is the median of CUDA-event (or wall, on the CPU) times over --iters calls after --warmup. `int8 mm` rows
time torch._int_mm alone on already-quantized operands, in the layout named: `W^T view` is the stored [N, K]
weight's transpose (column-major, no copy: cuBLASLt's int8 kernels want this "TN" layout), `W^T contiguous` the
row-major copy torchao's safe_int_mm makes of it. The `w8a8.*` rows are loraflow's own functions
(tasks/training/w8a8.py), quantization passes included; `compiled` rows the same function under torch.compile."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (name, K in, N out): the Linears of FLUX.1-dev's blocks; M = 4096 image + 512 text tokens (single blocks)
SHAPES = (("qkv/proj 3072x3072", 3072, 3072), ("ff in 3072x12288", 3072, 12288), ("ff out 12288x3072", 12288, 3072),
          ("single out 15360x3072", 15360, 3072))
TINY_SHAPES = (("tiny 64x128", 64, 128),)


def timed(fn, iters: int, warmup: int, cuda: bool) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def cases(M: int, K: int, N: int, device, compiled: bool = True):
    """name -> a zero-argument callable doing one multiply at [M, K] x [K, N] (or its input gradient)."""
    import torch

    from torchao.kernel.intmm import safe_int_mm
    from torchao.quantization import Int8Tensor, PerRow

    from tasks.training import w8a8
    from tasks.training.fp8_base import upcast

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=g).bfloat16()
    go = torch.randn(M, N, device=device, generator=g).bfloat16() * 1e-3
    w = (torch.randn(N, K, device=device, generator=g) / K ** 0.5).bfloat16()
    i8 = Int8Tensor.from_hp(w, PerRow())  # model.quantize=int8's weight
    qdata = i8.qdata
    w8 = w.to(torch.float8_e4m3fn)
    xq = torch.randint(-127, 128, (M, K), device=device, dtype=torch.int8)
    gq = torch.randint(-127, 128, (M, N), device=device, dtype=torch.int8)
    qt = qdata.t().contiguous()  # [K, N] row-major
    qcol = qdata.t().contiguous().t()  # [N, K] column-major (for g @ W)
    x8 = x.to(torch.float8_e4m3fn)
    sx = torch.ones(M, 1, device=device)
    ones_n = torch.ones(1, N, device=device)
    yield "bf16 forward", lambda: torch.nn.functional.linear(x, w)
    # the fallback (model.matmul=dequantize, auto's path for fp8 / int8): the weight upcast, then bf16's matmul;
    # the cast's own rate in GB/s (bytes read + written), as the fallback runs it three times a checkpointed step
    yield "fp8 weight upcast to bf16 (GB/s)", lambda: upcast(w8, torch.bfloat16), 3 * N * K
    yield "int8 weight dequantize to bf16 (GB/s)", lambda: upcast(i8, torch.bfloat16), 3 * N * K
    yield "fallback fp8 forward (upcast + bf16)", lambda: torch.nn.functional.linear(x, upcast(w8, torch.bfloat16))
    yield ("fallback int8 forward (dequantize + bf16)",
           lambda: torch.nn.functional.linear(x, upcast(i8, torch.bfloat16)))
    yield "bf16 grad_input", lambda: go @ w
    yield "int8 mm forward, W^T view", lambda: torch._int_mm(xq, qdata.t())
    yield "int8 mm forward, W^T contiguous", lambda: torch._int_mm(xq, qt)
    yield "int8 mm forward, safe_int_mm(W^T view)", lambda: safe_int_mm(xq, qdata.t())
    yield "int8 mm grad_input, W row-major", lambda: torch._int_mm(gq, qdata)
    yield "int8 mm grad_input, W column-major", lambda: torch._int_mm(gq, qcol)
    yield "int8 mm grad_input, W transposed copy each call", lambda: torch._int_mm(gq, qdata.t().contiguous().t())
    yield "fp8 scaled_mm forward, out fp32", lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=ones_n,
                                                                      out_dtype=torch.float32)
    yield "fp8 scaled_mm forward, out bf16", lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=ones_n,
                                                                      out_dtype=torch.bfloat16)
    yield "w8a8.int8_linear", lambda: w8a8.int8_linear(x, i8, None)
    yield "w8a8.int8_grad_input", lambda: w8a8.int8_grad_input(go, i8, torch.bfloat16)
    yield "w8a8.fp8_linear", lambda: w8a8.fp8_linear(x, w8, None)
    yield "w8a8.fp8_grad_input", lambda: w8a8.fp8_grad_input(go, w8, torch.bfloat16)
    if not compiled:
        return
    quant = torch.compile(lambda t: w8a8._per_token(t, 127.0))
    yield "per-token quantize only, eager", lambda: w8a8._per_token(x, 127.0)
    yield "per-token quantize only, compiled", lambda: quant(x)
    fp8_c = torch.compile(w8a8.fp8_linear)
    yield "w8a8.fp8_linear compiled", lambda: fp8_c(x, w8, None)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m bench.gpu_matmul", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4608)
    ap.add_argument("--out", default=None)
    ap.add_argument("--eager", action="store_true", help="leave out the compiled rows (no Inductor compile)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shapes, M = (TINY_SHAPES, 32) if args.tiny else (SHAPES, args.tokens)
    rows, t0 = [], time.time()
    out = Path(args.out or HERE / ("gpu_matmul_tiny.json" if args.tiny else "gpu_matmul.json"))
    for label, K, N in shapes:
        flops = 2 * M * K * N
        for name, fn, *moved in cases(M, K, N, device, not args.eager):
            row = {"shape": label, "M": M, "K": K, "N": N, "case": name}
            try:
                row["s"] = timed(fn, args.iters, args.warmup, cuda)
                if moved:  # a cast: its memory rate instead
                    row["gbps"] = moved[0] / row["s"] / 1e9
                else:
                    row["tflops"] = flops / row["s"] / 1e12
            except Exception as e:  # a kernel this machine lacks: recorded, the next case runs
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                row["traceback"] = traceback.format_exc()[-1500:]
            rows.append(row)
            rate = f"{row['tflops']:7.1f} TFLOP/s" if "tflops" in row else f"{row.get('gbps', 0):7.0f} GB/s"
            print(f"{label:>24} | {name:<48} | " + (f"{row['s'] * 1e3:8.3f} ms {rate}" if "s" in row
                                                    else row["error"][:80]), flush=True)
        result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows,
                  "seconds": round(time.time() - t0, 1)}
        out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
