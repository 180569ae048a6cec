"""model.matmul=w8a8: the frozen base's Linears multiply in the stored weight's own type, activations quantized on
the fly, instead of upcasting the weight to the compute dtype first (the fallback, `dequantize`).

- int8 base (torchao's Int8Tensor, one scale per output row): each token of the input is quantized to int8 with
  its own scale (symmetric, absmax / 127) and multiplied by `torch._int_mm` (cuBLASLt's int8 matmul on CUDA,
  the weight column-major as its fast kernels want; on the CPU torchao's safe_int_mm, an exact int32 matmul);
  the int32 result is scaled by the token's and the row's scales. The input gradient the same way: grad_out x
  the row scales, quantized per token, times the int8 weight.
- fp8 base (model.quantize=fp8: the weight cast to float8_e4m3fn, no scale, sd-scripts' --fp8_base numbers):
  each token quantized to float8_e4m3fn (absmax / 448) and multiplied by `torch._scaled_mm` (cuBLASLt's fp8
  matmul, row-wise scales); the input gradient per token in float8_e5m2 (gradients' range) against the weight.

The weight's numbers are the stored ones either way; what changes is the activation (and gradient) rounding: one
int8 / fp8 step per token, an error of about 1/254 (int8) or 2^-4 (e4m3) of the token's largest value, against
the fallback's bf16 rounding. OneTrainer trains its frozen base this way (LinearW8A8: torch._int_mm forward, an
int8 matmul for the input gradient; torch._scaled_mm for fp8); so does torchao's Float8DynamicActivation
Float8Weight inference config in SimpleTuner. It is opt-in: `auto` takes the fallback, measured faster on an
H200 (resolve()); fp8 needs compute capability 8.9+ (refused by validate elsewhere); report.json's
runtime.matmul names which ran. Shapes the kernels refuse (a side not a multiple of 16) run the fallback, layer
by layer.

The weights stay as stored: nothing here is saved for backward but the stored weight (fp8_base's Function).

model.matmul=bnb is an NF4 base's kernel path (bitsandbytes' matmul_4bit, tasks/training/nf4_kernel.py); resolve()
names it here too, so one function says which path a run takes."""
from __future__ import annotations

import functools
import importlib

from tasks.config_schema import ModelConfig
from tasks.lazy import lazy
from tasks.runtime import cuda_available

torch = lazy("torch")  # resolve() runs in a no-op's key: no torch there without a GPU

MODES = ("auto", "dequantize", "w8a8", "bnb")
INT8_MAX, E4M3_MAX, E5M2_MAX = 127.0, 448.0, 57344.0


def available(kind: str) -> bool:
    """Whether this machine's GPU has the kernel for a base stored as `kind` (fp8 | int8)."""
    if not cuda_available():
        return False
    return kind == "int8" or kind == "fp8" and torch.cuda.get_device_capability() >= (8, 9)


def kind_of(mc: ModelConfig) -> str | None:
    """The stored base these kernels take: "int8", "fp8" (model.quantize=fp8 or storage_dtype=float8_e4m3fn)."""
    q = mc.quantize or "none"
    if q in ("int8", "fp8"):
        return q
    return "fp8" if q == "none" and mc.storage_dtype == "float8_e4m3fn" else None


BNB_MISSING = ("model.matmul=bnb needs bitsandbytes, which does not import here (pip install bitsandbytes==0.50.2, "
               "constraints.txt's pin); or set model.matmul=dequantize (torchao's NF4, the fallback) or auto")


def bnb_importable() -> bool:
    """bitsandbytes imports: model.matmul=bnb runs wherever it does (its CPU backend has matmul_4bit too)."""
    try:
        importlib.import_module("bitsandbytes")
    except (ImportError, RuntimeError):  # RuntimeError: a backend of it failed to load
        return False
    return True


@functools.cache
def bnb_kernel() -> bool:
    """auto's test for an NF4 base: a CUDA GPU and bitsandbytes with its CUDA library loaded (its kernels; on the
    CPU its path is a dequantize and a matmul as the fallback's, so auto keeps the fallback there)."""
    if not cuda_available() or not bnb_importable():
        return False
    from bitsandbytes.cextension import lib

    return type(lib).__name__ == "CudaBNBNativeLibrary"


def resolve(mc: ModelConfig) -> str:
    """The matmul a run of model config `mc` uses: "w8a8", "bnb" (an NF4 base) or "dequantize". auto: bnb for an NF4
    base on a CUDA GPU with bitsandbytes' kernels, else the fallback (dequantize)."""
    mode, kind = mc.matmul or "auto", kind_of(mc)
    if (mc.quantize or "none") == "nf4":
        return "bnb" if mode == "bnb" or mode == "auto" and bnb_kernel() else "dequantize"
    if kind is None or mode in ("dequantize", "bnb"):  # bnb on an fp8 / int8 base: refused by config_checks
        return "dequantize"
    # auto: the fallback for fp8 / int8 bases, the faster path as measured on an H200 (bench/gpu_speed_fallback.json,
    # FLUX.1-dev 1024 px: the fp8 fallback 1.20x the bf16 step, int8's 1.39x, against w8a8's 1.44x / 1.57x): on
    # Hopper cuBLASLt's int8 matmul runs at bf16's rate and the per-token quantization costs more than fp8 saves.
    return "w8a8" if mode == "w8a8" else "dequantize"


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernels' shape rules (cuBLASLt: both sides of the weight multiples of 16), held on the CPU too so the
    same layers take the same path everywhere."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 and x.shape[-1] == weight.shape[1]


def _per_token(x: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] scaled per row into [-top, top]: (x / scale, scale [M, 1] in fp32); an all-zero row gets scale 1."""
    scale = x.abs().amax(dim=-1, keepdim=True).float() / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return x.float() / scale, scale


def _to_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] per token to int8 (absmax / 127): (int8 [M, K], scale [M, 1] fp32)."""
    xs, sx = _per_token(x, INT8_MAX)
    return xs.round().clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8), sx


def _grad_to_int8(g: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_out [M, N] times the weight's row scales, per token to int8."""
    return _to_int8(g.float() * row_scale.float().view(1, -1))


def _int8_out(acc: torch.Tensor, sx: torch.Tensor, row_scale: torch.Tensor, bias, dtype) -> torch.Tensor:
    """int32 [M, N] -> dtype: times the token's and the row's scales, plus the bias."""
    y = acc.float() * sx * row_scale.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def _scaled_out(acc: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return (acc.float() * scale).to(dtype)


def _to_fp8(x: torch.Tensor, top: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    xs, sx = _per_token(x, top)
    return xs.to(dtype), sx


def _fp8_out(y: torch.Tensor, bias, dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


# The quantization around each matmul is a few elementwise passes over the activations (and an fp32 [M, N] one
# after): eager, each its own kernel and memory round trip, they cost more than the int8 / fp8 matmul saves
# (bench/gpu_matmul.json, H200: quantizing a [4608, 3072] bf16 input 0.168 ms eager, 0.065 ms compiled, against
# 0.13 ms for the bf16 matmul itself). On CUDA they run compiled (fused by Inductor, shapes dynamic), as torchao's
# dynamic-quantization paths do; the matmul itself stays the eager kernel with the layout chosen below. Inside a
# region train.compile already compiles they are traced with it; anywhere else eager (the CPU: its bytes).
_FUSE = {"on": True}


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _fused(fn, *args):
    if args[0].is_cuda and _FUSE["on"] and not torch.compiler.is_compiling():
        try:
            return _compiled(fn)(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # no working Inductor here (no Triton, no compiler): eager, said once
            _FUSE["on"] = False
            import logging

            logging.getLogger(__name__).warning("model.matmul=w8a8: compiling the quantization failed (%s: %s); "
                                                "it runs eager", type(e).__name__, str(e).splitlines()[0][:200])
    return fn(*args)


def _int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 x b [K, N] int8 -> int32, exactly. CUDA: torch._int_mm (cuBLASLt) on _cuda_operands. The
    CPU: torchao's safe_int_mm, an int32 matmul: torch._int_mm's CPU kernel is not exact on an AVX2-only CPU
    (oneDNN's AVX2 int8 path saturates 16-bit partial sums: 36,546 off on a [24, 64] x [64, 48] product with the
    AVX2 kernels forced; exact with AVX-512 VNNI), and the same run must give the same LoRA on every x86 CPU."""
    if not a.is_cuda:
        from torchao.kernel.intmm import safe_int_mm

        return safe_int_mm(a, b)
    m = a.shape[0]
    out = torch._int_mm(*_cuda_operands(a, b))
    return out[:m] if m <= 16 else out


def _cuda_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch._int_mm's operands on CUDA: b column-major (the stored [N, K] weight's transpose is that already, the
    forward; grad_out @ W copies W transposed per call) and a with more than 16 rows (CUDA's minimum: a modulation
    Linear's batch is zero-padded). Measured on an H200 (bench/gpu_matmul.json, [4608, 3072] x [3072, 12288]):
    column-major b 0.50 ms (700 TFLOP/s; bf16's matmul 0.46 ms), row-major b 2.99 ms, torchao's safe_int_mm (it
    makes b row-major) 4.04 ms."""
    if a.shape[0] <= 16:
        a = torch.nn.functional.pad(a, (0, 0, 0, 17 - a.shape[0]))
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    return a, b


def int8_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b with W an Int8Tensor (per-row scales): int8 x int8 -> int32, then both scales."""
    shape = x.shape
    xq, sx = _fused(_to_int8, x.reshape(-1, shape[-1]))
    y = _fused(_int8_out, _int8_mm(xq, weight.qdata.t()), sx, weight.scale, bias, x.dtype)
    return y.reshape(*shape[:-1], weight.shape[0])


def int8_grad_input(grad_out: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
    """grad_out @ W for W = scale_row x qdata: (grad_out x scale_row) quantized per token, times qdata."""
    shape = grad_out.shape
    gq, sg = _fused(_grad_to_int8, grad_out.reshape(-1, shape[-1]), weight.scale)
    out = _fused(_scaled_out, _int8_mm(gq, weight.qdata), sg, dtype)
    return out.reshape(*shape[:-1], weight.shape[1])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b with W float8_e4m3fn (no scale): x per token to e4m3, torch._scaled_mm with row-wise scales."""
    shape = x.shape
    xq, sx = _fused(_to_fp8, x.reshape(-1, shape[-1]), E4M3_MAX, torch.float8_e4m3fn)
    ones = torch.ones(1, weight.shape[0], dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=ones, out_dtype=torch.float32)
    return _fused(_fp8_out, y, bias, x.dtype).reshape(*shape[:-1], weight.shape[0])


def fp8_grad_input(grad_out: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad_out @ W: grad_out per token to e5m2, times W (the kernel takes it column-major: one transposed copy)."""
    shape = grad_out.shape
    gq, sg = _fused(_to_fp8, grad_out.reshape(-1, shape[-1]), E5M2_MAX, torch.float8_e5m2)
    ones = torch.ones(1, weight.shape[1], dtype=torch.float32, device=grad_out.device)
    w = weight.t().contiguous().t()  # [out, in], column-major
    out = torch._scaled_mm(gq, w, scale_a=sg, scale_b=ones, out_dtype=torch.float32)
    return out.to(dtype).reshape(*shape[:-1], weight.shape[1])


def linear(x: torch.Tensor, weight, bias) -> torch.Tensor:
    return int8_linear(x, weight, bias) if type(weight).__name__ == "Int8Tensor" else fp8_linear(x, weight, bias)


def grad_input(grad_out: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
    if type(weight).__name__ == "Int8Tensor":
        return int8_grad_input(grad_out, weight, dtype)
    return fp8_grad_input(grad_out, weight, dtype)


def takes(weight) -> bool:
    """A stored weight this module multiplies: torchao's Int8Tensor or a plain float8_e4m3fn tensor."""
    if type(weight).__name__ == "Int8Tensor":
        return True
    return type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.dtype == torch.float8_e4m3fn
