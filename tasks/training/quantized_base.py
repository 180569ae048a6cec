"""A quantized frozen base for training (`model.quantize=int8|nf4`), stored by torchao:

- int8: torchao's `Int8Tensor` per output row, symmetric (Int8WeightOnlyConfig's default granularity, PerRow);
- nf4: torchao's `NF4Tensor` (QLoRA's 4-bit NormalFloat with double-quantized block scales: blocks of 64,
  scaler blocks of 256 or the largest power of two that divides the count; torchtune's QLoRA uses it); with
  model.matmul resolved to bnb, bitsandbytes' NF4 instead, multiplied by its matmul_4bit (nf4_kernel.py).

The quantized tensor replaces each frozen Linear's weight (a Parameter without grad), and the Linear runs
through fp8_base's autograd Function, which saves only the stored tensor and dequantizes it in forward and
again in backward: the compute-dtype copy lives for one layer. So the gradients are those through an upcast
copy of the same quantized weights (tests/test_quantized_base.py). Applied after peft wrapped the layers: the
LoRA (LoKr, LoHa, DoRA) trains in fp32 on top, and embeddings, norms, biases and what fp8_base's skip patterns
name stay in the compute dtype. Convolutions (the UNets') are not quantized; nor is a Linear whose size is not
a multiple of NF4's block (none in the real models; some in the tiny ones). `model.quantize=fp8` is
fp8_base.py's plain cast (sd-scripts' --fp8_base numbers: torchao's fp8 weight-only adds per-row scales and
dispatches to a scaled matmul, another set of numbers)."""
from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry

from tasks.training.fp8_base import HOOK_NAME, StorageCastHook, skipped

KINDS = ("none", "fp8", "int8", "nf4")
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256


def quantize_weight(weight: torch.Tensor, kind: str, matmul: str = "dequantize") -> torch.Tensor | None:
    """The stored form of a frozen weight, or None where the kind cannot hold it (NF4's block; the same layers
    whichever NF4 stores them). `matmul`: model.matmul resolved (w8a8.resolve)."""
    if kind == "nf4" and matmul == "bnb":
        from tasks.training import nf4_kernel

        return None if weight.numel() % NF4_BLOCK else nf4_kernel.quantize(weight)
    if kind == "int8":
        from torchao.quantization import Int8Tensor, PerRow

        return Int8Tensor.from_hp(weight, PerRow())
    if kind == "nf4":
        from torchao.quantization import to_nf4

        blocks = weight.numel() // NF4_BLOCK
        if weight.numel() % NF4_BLOCK:
            return None
        scaler = next(s for s in (NF4_SCALER_BLOCK >> i for i in range(9)) if blocks % s == 0)
        return to_nf4(weight, NF4_BLOCK, scaler)
    raise ValueError(f"model.quantize={kind!r}: choose one of {', '.join(KINDS)}")


def is_quantized(weight: torch.Tensor) -> bool:
    return type(weight).__name__ in ("Int8Tensor", "NF4Tensor", "BnbNF4")


class QuantizedHook(StorageCastHook):
    """fp8_base's hook with a torchao tensor as the stored weight."""

    def __init__(self, stored: torch.Tensor, compute_dtype: torch.dtype):
        super().__init__(None, compute_dtype)
        self.stored = stored

    def initialize_hook(self, module):
        module.weight = torch.nn.Parameter(self.stored, requires_grad=False)
        self.stored = None  # the module holds it
        if module.bias is not None:
            module.bias.data = module.bias.data.to(self.compute_dtype)
        return module


def quantize_base(model: torch.nn.Module, kind: str, compute_dtype: torch.dtype,
                  skip_patterns: tuple[str, ...], matmul: str = "dequantize") -> dict[str, list[str]]:
    """Stores every frozen Linear of `model` not matched by `skip_patterns` as `kind` (in the format `matmul`
    multiplies: quantize_weight). Returns {"quantized": paths, "kept": paths of the Linears the kind cannot hold}."""
    out = {"quantized": [], "kept": []}
    # on the GPU where there is one (seconds instead of minutes for a 20 B model, and no full-precision copy
    # of the model ever on it); the quantized weight stays there
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.requires_grad or skipped(path, skip_patterns):
            continue
        weight = module.weight.data
        # streamed in stored already (tasks/training/base_loading.py), or quantized here from the compute dtype
        stored = weight if is_quantized(weight) else quantize_weight(weight.to(device, compute_dtype), kind, matmul)
        if stored is None:
            out["kept"].append(path)
            continue
        HookRegistry.check_if_exists_or_initialize(module).register_hook(QuantizedHook(stored, compute_dtype), HOOK_NAME)
        out["quantized"].append(path)
    return out


def store_text_weight(weight: torch.Tensor, kind: str) -> torch.Tensor | None:
    """A text encoder's Linear weight as text.quantize stores it: fp8 (the plain cast), int8 or NF4 as above."""
    return weight.to(torch.float8_e4m3fn) if kind == "fp8" else quantize_weight(weight, kind)


def hook_stored(module: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """fp8_base's hook on a Linear whose weight is stored already: dequantized to `compute_dtype` for each matmul."""
    HookRegistry.check_if_exists_or_initialize(module).register_hook(StorageCastHook(None, compute_dtype), HOOK_NAME)


def text_loading(text_cfg):
    """text.quantize / text.offload as tasks/models/loading/text_load.py takes them, with these functions; a
    language model's output head dropped (the pipelines read hidden states)."""
    from tasks.models.loading.text_load import TextLoading

    from tasks.training.block_swap import swap_every_layer

    return TextLoading(text_cfg.quantize, bool(text_cfg.offload), store_text_weight, hook_stored, swap_every_layer,
                       head=False)
