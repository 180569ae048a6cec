"""train.blocks_to_swap=N: the frozen weights of the last N transformer blocks live in host memory (pinned with
CUDA) and are copied to the device a block ahead of their use, on a side stream, while the block before computes.

How: every frozen Linear/Conv of a swapped block runs through fp8_base's autograd Function (the layers the base
stores low or quantized already do; the others get the same hook, no cast). Its weight is held by the hook as a
`Swapped` weight, not by the module: `module.to(device)` leaves it on the host, and the module keeps an empty
placeholder. The Function saves only that host weight and asks it for its device copy in forward and again in
backward.

The copies follow musubi-tuner's `--block_swap_h2d_only` (its PR 972: a pinned master copy, one coalesced
host-to-device copy per block, frozen weights never copied back) and OneTrainer's LayerOffloadConductor (the next
layer's copy on a side stream, an event the compute stream waits on). Each swapped block's plain weights (bf16,
fp8) are packed into one pinned buffer at swap time, so a block is one copy; torchao's int8/NF4 tensors are copied
tensor by tensor in the same side-stream batch. When a layer of block i first asks for its weight, `BlockSwap`
waits for block i's copy, starts block i+1's (i-1 in backward, where the blocks run in reverse and gradient
checkpointing recomputes them) and drops every other block's device copy: at most two swapped blocks are on the
device at a time. Device copies are dropped, never copied back: the host copy is the master.

On the CPU the weights are used where they are (no copy), so the LoRA is byte-identical with and without swap
(tests/test_block_swap.py); the same scheduling runs there with `copy_on_host` (a test switch that copies anyway),
so the order of the copies and the two-block bound are checked without a GPU. DoRA reads the base weight directly
and is refused with it."""
from __future__ import annotations

from collections import deque

import torch
from diffusers.hooks import HookRegistry

from tasks.training.fp8_base import CASTABLE, HOOK_NAME, StorageCastHook


def blocks(denoiser: torch.nn.Module, lists: tuple[str, ...]) -> list[torch.nn.Module]:
    """The denoiser's transformer blocks in the order they run (the adapter's `swap_blocks` lists)."""
    return [b for name in lists for b in getattr(denoiser, name, ())]


def swap_every_layer(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Every repeated layer of a frozen `model` (the children of its outermost ModuleLists, in module order: a text
    encoder's layers, its vision tower's) swapped as `swap_blocks` swaps a denoiser's blocks; returns the bytes
    moved. A weight transformers keeps in fp32 still computes in fp32 (its hook's dtype is its own)."""
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    layers = [layer for n, m in named if not any(n.startswith(o + ".") for o, _ in named) for layer in m]
    for module in (m for layer in layers for m in layer.modules()):
        if isinstance(module, CASTABLE) and module.weight.dtype == torch.float32 != compute_dtype:
            registry = HookRegistry.check_if_exists_or_initialize(module)
            if registry.get_hook(HOOK_NAME) is None:
                registry.register_hook(StorageCastHook(None, torch.float32), HOOK_NAME)
    holder = torch.nn.Module()  # the layers side by side for swap_blocks; the model's own tree is unchanged
    holder.layers = torch.nn.ModuleList(layers)
    moved = swap_blocks(holder, ("layers",), len(layers), compute_dtype)
    model.loraflow_block_swap = holder.loraflow_block_swap
    return moved


def swap_blocks(denoiser: torch.nn.Module, lists: tuple[str, ...], n: int, compute_dtype: torch.dtype) -> int:
    """Moves the frozen Linear/Conv weights of the last `n` blocks to the host; returns the bytes moved. The blocks'
    `BlockSwap` is kept on the denoiser (`denoiser.loraflow_block_swap`)."""
    chosen = blocks(denoiser, lists)
    if n > len(chosen):
        from tasks.config import ConfigError
        raise ConfigError(f"train.blocks_to_swap={n}: this model has {len(chosen)} transformer blocks; swap "
                          f"{len(chosen)} or fewer")
    swap = BlockSwap()
    moved = 0
    for block in chosen[len(chosen) - n:]:
        layers = []
        for path, module in block.named_modules():
            if not isinstance(module, CASTABLE) or module.weight.requires_grad or "lora_" in path:
                continue
            registry = HookRegistry.check_if_exists_or_initialize(module)
            hook = registry.get_hook(HOOK_NAME)
            if hook is None:
                hook = StorageCastHook(None, compute_dtype)
                registry.register_hook(hook, HOOK_NAME)
            weight = module.weight.data if type(module.weight) is torch.nn.Parameter else module.weight
            layers.append((hook, weight.to("cpu")))
            # the placeholder in the dtype the layer computes in: callers read it (T5 casts its input to wo's)
            module.weight = torch.nn.Parameter(torch.empty(0, dtype=hook.compute_dtype, device=weight.device),
                                               requires_grad=False)
        moved += swap.add_block([host for _, host in layers], [hook for hook, _ in layers])
    denoiser.loraflow_block_swap = swap
    return moved


class Swapped:
    """A swapped layer's frozen weight: `host` (pinned; a view into its block's buffer where it is a plain tensor)
    and, while its block is resident, the device copy."""

    def __init__(self, swap: BlockSwap, block: int, slot: int, host: torch.Tensor):
        self.swap, self.block, self.slot, self.host = swap, block, slot, host

    def on(self, device: torch.device) -> torch.Tensor:
        """The weight on `device`: its block's device copy (waited for, the next block's copy started)."""
        if device.type == "cpu" and not self.swap.copy_on_host:
            return self.host
        return self.swap.enter(self.block, device)[self.slot]


class BlockSwap:
    """The swapped blocks in run order, each one pinned host buffer, and the device copies of at most two."""

    copy_on_host = False  # tests: run the copies on the CPU as well (there the weights are used where they are)

    def __init__(self):
        self.hosts: list[list[torch.Tensor]] = []  # per block: each layer's host weight
        self.buffers: list[torch.Tensor | None] = []  # per block: its plain weights packed (uint8), or None
        self.layouts: list[list] = []  # per block, per layer: (offset, dtype, shape) in the buffer, or None
        self.copies: dict[int, tuple[list[torch.Tensor], object]] = {}  # resident block -> (device weights, event)
        self.at: tuple[int, int] | None = None  # (block, direction) last entered
        self.stream = None  # the side stream (CUDA), made on first use
        self.copied = deque(maxlen=4096)  # (block, direction) of the latest block copies started: tests read it
        self.most_resident = 0

    def add_block(self, weights: list[torch.Tensor], hooks: list) -> int:
        """Packs one block's host weights into a pinned buffer; each hook gets its `Swapped`. Returns the bytes."""
        index, plain = len(self.hosts), [w for w in weights if type(w) is torch.Tensor]
        layout, offset = [], 0
        for w in weights:
            if type(w) is torch.Tensor:
                offset = -(-offset // ALIGN) * ALIGN  # each view starts aligned (any dtype's element size divides it)
                layout.append((offset, w.dtype, w.shape))
                offset += w.nbytes
            else:
                layout.append(None)
        buffer = None
        if plain:
            buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=torch.cuda.is_available())  # page-locked
            for w, spot in zip(weights, layout):
                if spot is not None:
                    _view(buffer, *spot).copy_(w)
        hosts = [w if spot is None else _view(buffer, *spot) for w, spot in zip(weights, layout)]
        hosts = [h if spot is not None else (_pinned(h) if torch.cuda.is_available() else h)
                 for h, spot in zip(hosts, layout)]
        self.hosts.append(hosts)
        self.buffers.append(buffer)
        self.layouts.append(layout)
        for slot, hook in enumerate(hooks):
            hook.host_weight = Swapped(self, index, slot, hosts[slot])
        return sum(stored_nbytes(h) for h in hosts)

    def enter(self, block: int, device: torch.device) -> list[torch.Tensor]:
        """Block `block`'s device weights, for a layer of it about to run. Its first layer to ask (in this pass and
        direction) waits for the copy, starts the next block's and drops the others'."""
        step = -1 if torch._C._current_graph_task_id() != -1 else 1  # in backward the blocks run in reverse
        if self.at != (block, step):
            self.at = (block, step)
            for other in [b for b in self.copies if b not in (block, block + step)]:
                del self.copies[other]  # dropped, never copied back: the host copy is the master
            self._start(block, device, step)
            self._wait(block, device)
            if 0 <= block + step < len(self.hosts):
                self._start(block + step, device, step)  # copied while this block computes
            self.most_resident = max(self.most_resident, len(self.copies))
        return self.copies[block][0]

    def _start(self, block: int, device: torch.device, step: int) -> None:
        if block in self.copies:
            return
        self.copied.append((block, step))
        if device.type != "cuda":
            self.copies[block] = (self._copy(block, device), None)
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self.stream):
            weights = self._copy(block, device)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copies[block] = (weights, event)

    def _copy(self, block: int, device: torch.device) -> list[torch.Tensor]:
        """One copy of the block's buffer, its weights views of it; other tensors one by one."""
        buffer = self.buffers[block]
        moved = buffer.to(device, non_blocking=True, copy=True) if buffer is not None else None
        # a torchao tensor moves by its own .to (NF4Tensor's refuses `copy`: a transfer to another device copies)
        return [h.to(device, non_blocking=True) if spot is None else _view(moved, *spot)
                for h, spot in zip(self.hosts[block], self.layouts[block])]

    def _wait(self, block: int, device: torch.device) -> None:
        weights, event = self.copies[block]
        if event is None:
            return
        compute = torch.cuda.current_stream(device)
        compute.wait_event(event)
        for w in weights:  # made on the side stream, used on this one: not reused before this stream is done
            for t in _inner(w):
                t.record_stream(compute)


ALIGN = 256  # bytes: CUDA's allocation granularity; every dtype's element size divides it


def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    n = shape.numel() * torch.empty((), dtype=dtype).element_size()
    return buffer[offset:offset + n].view(dtype).view(shape)


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a (torchao) tensor holds: what record_stream must be told about."""
    if type(t) is torch.Tensor:
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in _inner(getattr(t, n))]


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
