"""model.matmul=w8a8: the frozen base's Linears multiply in the stored weight's own type, activations quantized on
the fly, instead of upcasting the weight to the compute dtype first (the fallback, `dequantize`).

- int8 base (torchao's Int8Tensor, one scale per output row): each token of the input is quantized to int8 with
  its own scale (symmetric, absmax / 127) and multiplied by torchao's `safe_int_mm` (cuBLAS's int8 matmul on
  CUDA; an exact int32 matmul on the CPU); the int32 result is scaled by the token's and the row's scales. The
  input gradient the same way: grad_out x the row scales, quantized per token, times the int8 weight.
- fp8 base (model.quantize=fp8: the weight cast to float8_e4m3fn, no scale, sd-scripts' --fp8_base numbers):
  each token quantized to float8_e4m3fn (absmax / 448) and multiplied by `torch._scaled_mm` (cuBLASLt's fp8
  matmul, row-wise scales); the input gradient per token in float8_e5m2 (gradients' range) against the weight.

The weight's numbers are the stored ones either way; what changes is the activation (and gradient) rounding: one
int8 / fp8 step per token, an error of about 1/254 (int8) or 2^-4 (e4m3) of the token's largest value, against
the fallback's bf16 rounding. OneTrainer trains its frozen base this way (LinearW8A8: torch._int_mm forward, an
int8 matmul for the input gradient; torch._scaled_mm for fp8); so does torchao's Float8DynamicActivation
Float8Weight inference config in SimpleTuner. `auto` picks it on a CUDA GPU with the kernel (int8: any; fp8:
compute capability 8.9+), the fallback elsewhere, and report.json's runtime.matmul names which ran. Shapes the
kernels refuse (a side not a multiple of 16) run the fallback, layer by layer.

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
    """The matmul a run of model config `mc` uses: "w8a8", "bnb" (an NF4 base) or "dequantize" (auto: the
    kernel where the GPU has it, else the fallback)."""
    mode, kind = mc.matmul or "auto", kind_of(mc)
    if (mc.quantize or "none") == "nf4":
        return "bnb" if mode == "bnb" or mode == "auto" and bnb_kernel() else "dequantize"
    if kind is None or mode in ("dequantize", "bnb"):  # bnb on an fp8 / int8 base: refused by config_checks
        return "dequantize"
    return "w8a8" if mode == "w8a8" or available(kind) else "dequantize"


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernels' shape rules (cuBLASLt: both sides of the weight multiples of 16), held on the CPU too so the
    same layers take the same path everywhere."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 and x.shape[-1] == weight.shape[1]


def _per_token(x: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] scaled per row into [-top, top]: (x / scale, scale [M, 1] in fp32); an all-zero row gets scale 1."""
    scale = x.abs().amax(dim=-1, keepdim=True).float() / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return x.float() / scale, scale


def _int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from torchao.kernel.intmm import safe_int_mm

    return safe_int_mm(a, b)


def int8_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b with W an Int8Tensor (per-row scales): int8 x int8 -> int32, then both scales."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xs, sx = _per_token(x2, INT8_MAX)
    xq = xs.round().clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8)
    y = _int8_mm(xq, weight.qdata.t()).float() * sx * weight.scale.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


def int8_grad_input(grad_out: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
    """grad_out @ W for W = scale_row x qdata: (grad_out x scale_row) quantized per token, times qdata."""
    shape = grad_out.shape
    g = grad_out.reshape(-1, shape[-1]).float() * weight.scale.float().view(1, -1)
    gs, sg = _per_token(g, INT8_MAX)
    gq = gs.round().clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8)
    out = _int8_mm(gq, weight.qdata).float() * sg
    return out.to(dtype).reshape(*shape[:-1], weight.shape[1])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b with W float8_e4m3fn (no scale): x per token to e4m3, torch._scaled_mm with row-wise scales."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xs, sx = _per_token(x2, E4M3_MAX)
    ones = torch.ones(1, weight.shape[0], dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(xs.to(torch.float8_e4m3fn), weight.t(), scale_a=sx, scale_b=ones, out_dtype=torch.float32)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


def fp8_grad_input(grad_out: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad_out @ W: grad_out per token to e5m2, times W (the kernel takes it column-major: one transposed copy)."""
    shape = grad_out.shape
    gs, sg = _per_token(grad_out.reshape(-1, shape[-1]), E5M2_MAX)
    ones = torch.ones(1, weight.shape[1], dtype=torch.float32, device=grad_out.device)
    w = weight.t().contiguous().t()  # [out, in], column-major
    out = torch._scaled_mm(gs.to(torch.float8_e5m2), w, scale_a=sg, scale_b=ones, out_dtype=torch.float32)
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
