"""An fp8-stored frozen base for training (`model.storage_dtype`): each frozen Linear/Conv weight is kept in
fp8 and cast to the compute dtype inside one autograd Function, which saves only the fp8 weight for the
backward pass and casts it again there. The compute-dtype copy lives for one layer's forward (or backward).

Why not diffusers' layerwise casting (used before): it is an inference hook that swaps each Parameter's
storage with `module.to()` around forward. Autograd has saved that Parameter, so backward either sees the
fp8 storage (conv on AVX2 CPUs: "expected scalar type BFloat16 but found Float8_e4m3fn") or keeps the bf16
copy alive until backward, which saves no memory in training. Why not a library: torchao's float8 training
quantizes activations and gradients too and needs CUDA's scaled matmul; its and optimum-quanto's weight-only
fp8 add per-channel scales (other numbers than sd-scripts' plain `--fp8_base` cast) and quanto is in
maintenance. This is the plain cast, the same numbers as an upcast copy of the fp8 weights (tested).

Embeddings are never stored in fp8 (no fp8 index_select: sd-scripts' failure, seeds.md 1)."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook

from tasks.training import w8a8 as kernels

# Registered under diffusers' layerwise-casting name: `ModelMixin.dtype` reads that hook's `compute_dtype`,
# so pipelines built around the training denoiser (samples during training) see bf16, not fp8.
HOOK_NAME = "layerwise_casting"
CASTABLE = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def upcast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stored weight in the compute dtype: fp8 cast, or a torchao / bnb tensor dequantized (quantized_base.py)."""
    if type(weight).__name__ in ("Int8Tensor", "BnbNF4"):  # their .to keeps them quantized
        return weight.dequantize(dtype)
    return weight.to(dtype)


def on_device(weight, device: torch.device) -> torch.Tensor:
    """The stored weight on `device`: where it is, or a swapped block's device copy (block_swap.Swapped)."""
    return weight if isinstance(weight, torch.Tensor) else weight.on(device)


def _saved(ctx, weight):
    """Saves the weight as stored for backward: a tensor through autograd, a swapped weight (its host copy and its
    block) on ctx."""
    if isinstance(weight, torch.Tensor):
        ctx.save_for_backward(weight)
    else:
        ctx.swapped = weight


def _stored(ctx):
    return ctx.swapped if hasattr(ctx, "swapped") else ctx.saved_tensors[0]


class _LinearFromStorage(torch.autograd.Function):
    """y = x @ W^T + b with W stored low; saves W as stored (not its upcast copy); W and b take no grad. W may
    live on the host (train.blocks_to_swap): its device copy is asked for in forward, and again in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, compute_dtype, w8a8=False):
        _saved(ctx, weight)
        ctx.compute_dtype, ctx.x_dtype = compute_dtype, x.dtype
        w = on_device(weight, x.device)
        # model.matmul=w8a8: the stored type's own matmul, activations quantized per token (w8a8.py)
        ctx.w8a8 = w8a8 and kernels.takes(w) and kernels.fits(x, w)
        if ctx.w8a8:
            return kernels.linear(x, w, bias)
        if type(w).__name__ == "BnbNF4":  # model.matmul=bnb (nf4_kernel.py); backward's upcast is bnb's own
            from tasks.training import nf4_kernel

            return nf4_kernel.linear(x, w, bias, compute_dtype)
        return F.linear(x, upcast(w, compute_dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        weight = on_device(_stored(ctx), grad_out.device)
        grad_x = None
        if ctx.needs_input_grad[0] and ctx.w8a8:
            grad_x = kernels.grad_input(grad_out, weight, ctx.x_dtype)
        elif ctx.needs_input_grad[0]:
            grad_x = (grad_out @ upcast(weight, grad_out.dtype)).to(ctx.x_dtype)
        return grad_x, None, None, None, None


class _ConvFromStorage(torch.autograd.Function):
    """conv(x, W) + b with W stored low: saves W as stored and the input's shape only."""

    @staticmethod
    def forward(ctx, x, weight, bias, compute_dtype, stride, padding, dilation, groups):
        _saved(ctx, weight)
        ctx.geometry = (x.shape, x.dtype, stride, padding, dilation, groups)
        weight = on_device(weight, x.device)
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[weight.dim()]
        return conv(x, weight.to(compute_dtype), bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad_out):
        weight = on_device(_stored(ctx), grad_out.device)
        shape, x_dtype, stride, padding, dilation, groups = ctx.geometry
        grad_x = None
        if ctx.needs_input_grad[0]:
            shaped = grad_out.new_empty(1).expand(shape)  # convolution_backward reads only the input's shape
            n = weight.dim() - 2
            grad_x = torch.ops.aten.convolution_backward(
                grad_out, shaped, weight.to(grad_out.dtype), None, stride, padding,
                dilation, False, [0] * n,
                groups, (True, False, False))[0].to(x_dtype)
        return (grad_x,) + (None,) * 7


@torch.compiler.disable
def _eager_linear(x, weight, bias, compute_dtype, w8a8):
    """A torchao weight (int8, NF4) or a swapped one, outside train.compile's graphs: inductor refuses a graph whose
    tensor-subclass inputs alias its outputs (the weight autograd saves), and a swap's copies are stream work. The
    rest of the block (attention, norms, the LoRA) still compiles around it."""
    return _LinearFromStorage.apply(x, weight, bias, compute_dtype, w8a8)


class StorageCastHook(ModelHook):
    """Replaces a frozen Linear/Conv's forward with the autograd-safe cast from its stored (fp8) weight."""

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype | None, compute_dtype: torch.dtype):
        super().__init__()
        self.storage_dtype, self.compute_dtype = storage_dtype, compute_dtype
        self.host_weight = None  # train.blocks_to_swap: the weight, held here on the host (block_swap.Swapped)
        self.w8a8 = False  # model.matmul resolved to w8a8 (set_matmul)

    def initialize_hook(self, module):
        if self.storage_dtype is not None:  # None: kept as it is (a swapped block's unstored layer)
            module.weight.data = module.weight.data.to(self.storage_dtype)
        if module.bias is not None:  # small; kept in the compute dtype so forward adds it without a cast
            module.bias.data = module.bias.data.to(self.compute_dtype)
        return module

    def new_forward(self, module, x, *args, **kwargs):
        weight, bias = module.weight if self.host_weight is None else self.host_weight, module.bias
        if isinstance(module, torch.nn.Linear):
            if type(weight) in (torch.Tensor, torch.nn.Parameter):  # fp8: traced by train.compile
                return _LinearFromStorage.apply(x, weight, bias, self.compute_dtype, self.w8a8)
            return _eager_linear(x, weight, bias, self.compute_dtype, self.w8a8)
        if module.padding_mode != "zeros":  # pad outside the Function: autograd differentiates F.pad
            x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
            padding = (0,) * (x.dim() - 2)
        else:
            padding = module.padding
        return _ConvFromStorage.apply(x, weight, bias, self.compute_dtype, module.stride, padding,
                                      module.dilation, module.groups)


def castable(module: torch.nn.Module) -> bool:
    # padding="same"/"valid" strings have no convolution_backward form here; none of our denoisers uses them
    return isinstance(module, CASTABLE) and not isinstance(getattr(module, "padding", 0), str)


def skipped(path: str, skip_patterns: tuple[str, ...]) -> bool:
    """diffusers' layerwise-casting rule: a pattern matching the module's path at any level skips it.
    peft's wrappers are transparent (`x.base_layer` is matched as `x`), and its adapter layers never cast."""
    parts = [p for p in path.split(".") if p != "base_layer"]
    if any(p.startswith("lora_") for p in parts):
        return True
    return any(re.search(p, ".".join(parts[:i])) for i in range(1, len(parts) + 1) for p in skip_patterns)


def store_base_low(model: torch.nn.Module, storage_dtype: torch.dtype, compute_dtype: torch.dtype,
                   skip_patterns: tuple[str, ...]) -> list[str]:
    """Stores every frozen Linear/Conv weight of `model` not matched by `skip_patterns` in `storage_dtype`,
    computing in `compute_dtype`. Apply after peft added its layers (their fp32 weights stay as they are).
    Returns the paths of the layers stored low."""
    stored = []
    for path, module in model.named_modules():
        if not castable(module) or module.weight.requires_grad or skipped(path, skip_patterns):
            continue
        HookRegistry.check_if_exists_or_initialize(module).register_hook(
            StorageCastHook(storage_dtype, compute_dtype), HOOK_NAME)
        stored.append(path)
    return stored


def set_matmul(model: torch.nn.Module, mode: str) -> int:
    """model.matmul as resolved (w8a8.resolve) on every stored-weight layer of `model`; returns how many."""
    hooks = [m._diffusers_hook.get_hook(HOOK_NAME) for m in model.modules() if hasattr(m, "_diffusers_hook")]
    hooks = [h for h in hooks if isinstance(h, StorageCastHook)]
    for hook in hooks:
        hook.w8a8 = mode == "w8a8"
    return len(hooks)
