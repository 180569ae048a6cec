"""What FLUX.1-dev LoRA training holds, measured from real tensors on the CPU (no GPU needed).

    python -m bench.memory [--out bench/memory.json] [--rank 16] [--only bf16,fp8+ckpt]

Weights: the exact bytes of the model the train node prepares (bench/gpu.py `build`, i.e.
tasks.train_setup.prepare_denoiser: peft LoRA on the Flux adapter's default targets, fp32 LoRA, the fp8 base of
tasks/fp8_base.py, gradient checkpointing). LoRA: fp32 weights + fp32 gradients + optimizer state (AdamW: two
fp32 moments, 8 bytes a parameter; 8-bit AdamW: two 1-byte moments, 2 bytes a parameter).

Activations: one training forward (the Flux adapter's own `training_loss`, under bf16 autocast as
`train.mixed_precision=bf16` runs it) and backward of the full 19 + 38 block model, with every tensor autograd
saves seen through `torch.autograd.graph.saved_tensors_hooks`; each distinct storage counted once, module
parameters (bf16/fp8 base weights, LoRA weights) left out (they are the weight term). With gradient
checkpointing, what the outer hook sees is each block's checkpointed inputs; the block internals a recompute
saves during backward are caught by wrapping torch.utils.checkpoint's recomputation hook, and the largest
recompute is added. The model runs under FakeTensorMode: tensors carry real shapes, dtypes and the CPU device
(so CPU autocast and the CPU attention kernel choice apply) but hold no memory and do no arithmetic.
tests/test_bench_memory.py checks the byte counts equal a real CPU run's at a reduced size.

What is held = weights + LoRA, gradients, optimizer + saved activations (+ the largest recompute). Left out:
transient buffers (the gradient flowing between blocks, one layer's upcast fp8 weight, matmul workspaces),
the CUDA context and allocator fragmentation: a GPU's peak is somewhat higher (bench/gpu.py measures that).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
# (name, fp8 base, gradient checkpointing, modulation linears in fp8 too)
CONFIGS = (("bf16", False, False, False), ("bf16+ckpt", False, True, False), ("fp8+ckpt", True, True, False),
           ("fp8-all+ckpt", True, True, True))
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2}  # per LoRA parameter: two fp32 moments / two 1-byte moments


def _key(t):
    """One key per storage: views of one storage share it."""
    return t.untyped_storage()._cdata


class SavedTensors:
    """Distinct storages autograd saves (outer hook) and those each checkpoint recompute saves, parameters out."""

    def __init__(self, model):
        self.params = {_key(p) for p in model.parameters()}
        self.saved: dict[int, int] = {}  # storage -> bytes
        self.keep: list = []  # keeps storages alive while counted, so no key is reused
        self.recomputes: list[int] = []

    def _add(self, t, into: dict) -> None:
        k = _key(t)
        if k not in self.params and k not in self.saved and k not in into:
            into[k] = t.untyped_storage().nbytes()
            self.keep.append(t)

    def hooks(self):
        def pack(t):
            self._add(t, self.saved)
            return t
        return __import__("torch").autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    @contextlib.contextmanager
    def recompute_hooks(self):
        """torch.utils.checkpoint looks `_recomputation_hook` up at each recompute: a subclass counts what the
        recompute of one block saves, then hands it on."""
        import torch.utils.checkpoint as cp

        original, counter = cp._recomputation_hook, self

        class Counting(original):
            def __init__(self, *args):
                super().__init__(*args)
                inner, seen = self.pack_hook, {}
                counter.recomputes.append(0)

                def pack(t):
                    counter._add(t, seen)
                    counter.recomputes[-1] = sum(seen.values())
                    return inner(t)
                self.pack_hook = pack

        cp._recomputation_hook = Counting
        try:
            yield
        finally:
            cp._recomputation_hook = original

    @property
    def total(self) -> int:
        return sum(self.saved.values())


def _to_fake(model, params, mode) -> list:
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    lora = {id(p) for p in params}
    out = []
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            fake = torch.nn.Parameter(FakeTensor(mode, p.data, torch.device("cpu")), requires_grad=p.requires_grad)
            setattr(module, name, fake)
            if id(p) in lora:
                out.append(fake)
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, FakeTensor(mode, b, torch.device("cpu")))
    return out


def measure(arch: dict, resolution: int, text_len: int, fp8: bool, ckpt: bool, modulation: bool, rank: int,
            fake: bool = True) -> dict:
    """Bytes one training step of this configuration holds (see the module doc). `fake=False`: real tensors."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.gpu import TRAIN_CFG, build, inputs

    cpu = torch.device("cpu")
    scheduler = FlowMatchEulerDiscreteScheduler()
    torch.manual_seed(0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    # Fake: prepared on the meta device (peft's and fp8's conversions do not run on fake tensors), then each
    # parameter becomes a fake CPU tensor with the same shape, dtype and requires_grad.
    adapter, model, params = build(arch, torch.device("meta") if fake else cpu, fp8, ckpt, rank, modulation)
    if fake:
        params = _to_fake(model, params, mode)
    with mode or contextlib.nullcontext():
        lora = {_key(p) for p in params}
        weights = sum(p.numel() * p.element_size() for p in model.parameters() if _key(p) not in lora)
        lora_params = sum(p.numel() for p in params)
        latents, text = inputs(arch, resolution, text_len, 1, cpu)
        counter = SavedTensors(model)
        with counter.hooks(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = adapter.training_loss(model, latents, text, TRAIN_CFG, scheduler, [torch.Generator().manual_seed(0)])
        with counter.recompute_hooks():
            loss.backward()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        saved, recompute = counter.total, max(counter.recomputes, default=0)
        del model, params, latents, text, loss, counter
    return {"weights_bytes": weights, "lora_params": lora_params, "lora_grad_bytes": grads,
            "saved_bytes": saved, "recompute_bytes": recompute, "activation_bytes": saved + recompute}
