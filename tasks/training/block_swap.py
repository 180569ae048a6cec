"""train.blocks_to_swap=N: the frozen weights of the last N transformer blocks live in host memory (pinned with
CUDA) and are copied to the device for each use, as musubi-tuner's and OneTrainer's block swap keep only some
blocks resident.

How: every frozen Linear/Conv of a swapped block runs through fp8_base's autograd Function (the layers the
base stores low or quantized already do; the others get the same hook, no cast), whose weight is held by the
hook, on the host, instead of by the module: `module.to(device)` leaves it there, and the module keeps an empty
placeholder. The Function copies the weight to the input's device in forward and again in backward
(`non_blocking` from pinned memory), saving only the host tensor, so the device holds one layer's weight at a
time beyond the resident blocks. The LoRA layers, biases, norms and everything outside the swapped blocks stay
on the device. musubi-tuner swaps whole blocks a block ahead on a side stream (overlapping copy and compute);
this copies per layer on the compute stream: the same bytes on the device, more time waiting (bench/ on a GPU
says how much). On the CPU the same code path runs (the copy is a no-op) and the LoRA is byte-identical with
and without swap (tests/test_block_swap.py). DoRA reads the base weight directly and is refused with it."""
from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry

from tasks.training.fp8_base import CASTABLE, HOOK_NAME, StorageCastHook


def blocks(denoiser: torch.nn.Module, lists: tuple[str, ...]) -> list[torch.nn.Module]:
    """The denoiser's transformer blocks in the order they run (the adapter's `swap_blocks` lists)."""
    return [b for name in lists for b in getattr(denoiser, name, ())]


def swap_blocks(denoiser: torch.nn.Module, lists: tuple[str, ...], n: int, compute_dtype: torch.dtype) -> int:
    """Moves the frozen Linear/Conv weights of the last `n` blocks to the host; returns the bytes moved."""
    chosen = blocks(denoiser, lists)
    if n > len(chosen):
        from tasks.config import ConfigError
        raise ConfigError(f"train.blocks_to_swap={n}: this model has {len(chosen)} transformer blocks; swap "
                          f"{len(chosen)} or fewer")
    pin = torch.cuda.is_available()
    moved = 0
    for block in chosen[len(chosen) - n:]:
        for path, module in block.named_modules():
            if not isinstance(module, CASTABLE) or module.weight.requires_grad or "lora_" in path:
                continue
            registry = HookRegistry.check_if_exists_or_initialize(module)
            hook = registry.get_hook(HOOK_NAME)
            if hook is None:
                hook = StorageCastHook(None, compute_dtype)
                registry.register_hook(hook, HOOK_NAME)
            weight = module.weight.data if type(module.weight) is torch.nn.Parameter else module.weight
            host = weight.to("cpu")
            hook.host_weight = _pinned(host) if pin else host
            moved += stored_nbytes(host)
            module.weight = torch.nn.Parameter(torch.empty(0, dtype=compute_dtype, device=weight.device),
                                               requires_grad=False)
    return moved


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """Page-locked, for copies that do not block; a tensor subclass that cannot be pinned is copied from
    pageable memory instead (slower, the same bytes)."""
    try:
        return t.pin_memory()
    except (RuntimeError, NotImplementedError, TypeError):
        return t


def stored_nbytes(t: torch.Tensor) -> int:
    if type(t) is torch.Tensor:
        return t.nbytes
    names, _ = t.__tensor_flatten__()  # a torchao tensor: the tensors it holds
    return sum(getattr(t, n).nbytes for n in names)
