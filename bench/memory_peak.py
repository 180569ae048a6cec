"""The peak of live tensor bytes over a whole training step, what a GPU's torch.cuda.max_memory_allocated shows,
measured on the CPU (bench.memory's saved-tensor count leaves the transients out: issue 43, item 3).

`LivePeak` is a TorchDispatchMode: every op's output storage is counted when it appears and uncounted when it
dies (a weakref callback on the untyped storage: views share it, so a storage counts once), and the running
total's maximum is kept, with the live bytes per creating op at that moment (the breakdown). Under FakeTensorMode the
same code runs at the real architecture's sizes without memory; `tests/test_memory_peak.py` checks the fake
count equals a real CPU run's at a reduced size, op for op.

What it cannot see is inside a torchao tensor (NF4Tensor / Int8Tensor do not run on fake tensors): the dequantize
of the frozen weight in flight (tasks/training/fp8_base.py `upcast`). `upcast_bytes_per_element` measures that
on real small CPU tensors with the same tracker (the peak inside the call, its bf16 output included, per
element), and the fake run adds it at each upcast of a weight stored that way (`transient_upcast`). Left out:
kernel workspaces (cuBLAS's, a few MiB), the CUDA context and allocator fragmentation."""
from __future__ import annotations

from tasks.config_schema import TrainConfig
import contextlib
import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

GIB = 1 << 30


class LivePeak(TorchDispatchMode):
    """Live storage bytes: `current`, `peak`, and at the peak `phase`, `op` and the bytes per label (`at_peak`)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple] = {}  # id(storage) -> (weakref, bytes, label)
        self.current = self.peak = 0
        self.phase, self.peak_phase, self.op, self.peak_op = "forward", None, None, None
        self.by_label: dict[str, int] = {}  # live bytes per label, kept as storages come and go
        self.at_peak: dict[str, int] = {}
        self.extra = None  # (bytes, label) of a transient the dispatcher does not see (an upcast's inside)

    def _add(self, t: torch.Tensor, label: str, counted: bool = True) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.live:
            return
        n = st.nbytes() if counted else 0

        def dead(_, key=key):
            _, gone, lab = self.live.pop(key)
            self.current -= gone
            self.by_label[lab] -= gone
        self.live[key] = (weakref.ref(st, dead), n, label)
        self.current += n
        self.by_label[label] = self.by_label.get(label, 0) + n

    def hold(self, tensors, label: str) -> None:
        """Tensors made before the step that stay (LoRA, optimizer state): counted from now on."""
        for t in tensors:
            self._add(t, label)
        self._update(label)

    def ignore(self, tensors) -> None:
        """Tensors counted elsewhere (the base weights: their stored bytes): a view of one adds nothing."""
        for t in tensors:
            self._add(t, "ignored", counted=False)

    def to_host(self, t: torch.Tensor) -> None:
        """A storage that lives in host memory on a GPU machine (offloaded): no longer counted."""
        ref, n, label = self.live[id(t.untyped_storage())]
        self.live[id(t.untyped_storage())] = (ref, 0, label)
        self.current -= n
        self.by_label[label] -= n

    def transient(self, nbytes: int, label: str) -> None:
        """A moment at `nbytes` above what is live now (then gone)."""
        self.extra = (nbytes, label)
        self._update(label)
        self.extra = None

    def _update(self, op: str) -> None:
        now = self.current + (self.extra[0] if self.extra else 0)
        if now > self.peak:
            self.peak, self.peak_phase, self.peak_op = now, self.phase, op
            self.at_peak = {k: v for k, v in self.by_label.items() if v}
            if self.extra:
                self.at_peak[self.extra[1]] = self.extra[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        label = f"{self.phase}:{func.__name__}"
        tree_map_only(torch.Tensor, lambda t: self._add(t, label), out)
        self._update(label)
        return out

    def summary(self) -> dict:
        """The peak and what was live then, grouped by label (bytes)."""
        groups = self.at_peak
        return {"peak_bytes": self.peak, "phase": self.peak_phase, "op": self.peak_op,
                "at_peak": dict(sorted(groups.items(), key=lambda kv: -kv[1]))}


@functools.lru_cache(maxsize=8)
def upcast_bytes_per_element(kind: str, rows: int = 256, cols: int = 1024) -> float:
    """The peak bytes inside fp8_base.upcast of a weight stored as `kind`, its bf16 output included, per element:
    measured on a real random CPU weight (the stored tensor itself not counted: it is the weight term)."""
    from tasks.training.fp8_base import upcast
    from tasks.training.quantized_base import quantize_weight

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    if kind == "bf16":
        return 0.0  # no upcast: the layer uses its weight as it is
    stored = w.to(torch.float8_e4m3fn) if kind == "fp8" else quantize_weight(w, kind)
    with LivePeak() as tracker:
        out = upcast(stored, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    return tracker.peak / w.numel()


@contextlib.contextmanager
def transient_upcast(tracker: LivePeak, kinds: dict[int, tuple[str, int, str]]):
    """fp8_base.upcast, looked up at each call, reports the inside of a quantized weight's dequantize: `kinds`
    maps id(fake weight) -> (storage kind, host copy bytes when the layer is swapped else 0, module path)."""
    from tasks.training import fp8_base

    original = fp8_base.upcast

    def counted(weight, dtype):
        kind, host_copy, path = kinds.get(id(weight), (None, 0, ""))
        if kind is not None:
            inside = round(upcast_bytes_per_element(kind) * weight.numel())
            tracker.transient(inside + host_copy, f"upcast of {path} ({kind})")
        return original(weight, dtype)

    fp8_base.upcast = counted
    try:
        yield
    finally:
        fp8_base.upcast = original


@contextlib.contextmanager
def host_offload(tracker: LivePeak):
    """train.gradient_checkpointing_offload's save_on_cpu as on a GPU: the packed copy is host memory (not
    counted), the device tensor may die; unpacking makes a device copy again. On the CPU `.cpu()` and `.to(cpu)`
    return the tensor itself, so both copies are made explicit here (clones: the same bytes and lifetimes)."""
    from tasks.training import activation_offload

    original = activation_offload.save_on_cpu

    class OnHost(original):
        def __init__(self, pin_memory=False):
            super().__init__(pin_memory)

            def pack(t):
                host = t.clone()
                tracker.to_host(host)
                return host
            self.pack_hook, self.unpack_hook = pack, lambda host: host.clone()

    activation_offload.save_on_cpu = OnHost
    try:
        yield
    finally:
        activation_offload.save_on_cpu = original


def step_peak(adapter, model, params, latents, text, scheduler, tracker: LivePeak, train_cfg: TrainConfig) -> dict:
    """One training step as bench.gpu.train_step takes it (bf16 autocast, backward with the checkpoint recomputes,
    gradient clipping, AdamW, zero_grad), in steady state: the optimizer's moments exist before it (a first step
    makes them). The base weights are ignored (the caller adds their stored bytes); the LoRA and the moments held."""
    from tasks.training.train_setup import make_optimizer

    lora = {id(p) for p in params}
    tracker.ignore([p for p in model.parameters() if id(p) not in lora])
    tracker.ignore([b for b in model.buffers()])
    tracker.ignore([latents, *text.values()])  # the batch: counted below, as the GPU holds it
    opt = make_optimizer(train_cfg, params)
    for group in opt.param_groups:  # what torch picks for CUDA tensors (its intermediates are the GPU's)
        group["foreach"] = True
    for p in params:  # the moments as after step 1, without a forward
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    batch = sum(t.untyped_storage().nbytes() for t in (latents, *text.values()))
    with tracker:
        tracker.hold(params, "LoRA weights")
        tracker.hold([s for st in opt.state.values() for s in st.values() if torch.is_tensor(s)], "AdamW moments")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = adapter.training_loss(model, latents, text, train_cfg, scheduler, [torch.Generator().manual_seed(0)])
        tracker.phase = "backward"
        loss.backward()
        del loss
        tracker.phase = "optimizer"
        torch.nn.utils.clip_grad_norm_(params, train_cfg.max_grad_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = tracker.summary()
    out["peak_bytes"] += batch
    out["at_peak"]["batch (latents, text)"] = batch
    return out


def family_peak(name: str, resolution: int = 1024, text_len: int = 512, rank: int = 16) -> dict:
    """The live peak of a bench.memory_families row `<model>:<options>`: the stored base weights on the device
    (bench.memory_families.weights, less its static one-layer-in-flight term: the run sees each upcast) + the
    fake step's live peak. A stored base runs fp8_base's path (fp8 storage on the fake tensors, the same autograd
    Function and saved tensors) with each quantized Linear's dequantize inside added at its upcast; a swapped
    layer's copy of its stored weight to the device is added there too (block swap itself does not run on fake
    tensors; the device holds the same bytes)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.hooks import HookRegistry
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.flux_train import TRAIN_CFG
    from bench.fake_step import to_fake
    from bench.family_models import batch_inputs, parse, quantized_bytes, random_adapter, train_config, weights
    from tasks.training.block_swap import blocks
    from tasks.training.fp8_base import HOOK_NAME
    from tasks.training.train_setup import prepare_denoiser

    model, options = name.split(":")
    opts = parse(options)
    stored = opts["store"] in ("fp8", "int8", "nf4")
    adapter, _, _ = random_adapter(model, torch.device("meta"))
    run = {**opts, "store": "fp8" if stored else "bf16", "swap": 0}
    den, named = prepare_denoiser(adapter, train_config(run, text_len, rank))
    den.train()
    swapped = {id(m) for b in blocks(den, adapter.swap_blocks)[len(blocks(den, adapter.swap_blocks)) - opts["swap"]:]
               for m in b.modules()} if opts["swap"] else set()
    scheduler = FlowMatchEulerDiscreteScheduler()  # real tensors: made outside the fake mode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = to_fake(den, list(named.values()), mode)
    kinds = {}
    for path, m in den.named_modules():
        hook = HookRegistry.check_if_exists_or_initialize(m).get_hook(HOOK_NAME) if hasattr(m, "weight") else None
        if hook is not None and isinstance(m, torch.nn.Linear):
            shape = tuple(m.weight.shape)
            copy = quantized_bytes(shape, opts["store"]) if id(m) in swapped else 0
            kinds[id(m.weight)] = (opts["store"], copy, path)
    w = weights(model, opts)
    tracker = LivePeak()
    with mode, transient_upcast(tracker, kinds), host_offload(tracker):
        latents, text = batch_inputs(model, dict(den.config), resolution, text_len)
        out = step_peak(adapter, den, params, latents, text, scheduler, tracker, TRAIN_CFG)
    resident = w["device"] - w["in_flight"]
    out["at_peak"] = {"base weights (stored)": resident, **out["at_peak"]}
    out["peak_bytes"] += resident
    return out


def flux_peak(arch: dict, resolution: int, text_len: int, fp8: bool, ckpt: bool, modulation: bool, rank: int,
              fake: bool = True) -> dict:
    """bench.memory's FLUX.1 configurations (bench.gpu.build: the train node's prepare_denoiser): the stored base
    weights + the step's live peak (an fp8 base's upcast is seen as it runs). `fake=False`: real CPU tensors."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.flux_train import TRAIN_CFG, build, inputs
    from bench.fake_step import to_fake

    torch.manual_seed(0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    adapter, model, params = build(arch, torch.device("meta" if fake else "cpu"), fp8, ckpt, rank, modulation)
    if fake:
        params = to_fake(model, params, mode)
    scheduler = FlowMatchEulerDiscreteScheduler()
    lora = {id(p) for p in params}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in lora)
    with mode or contextlib.nullcontext():
        latents, text = inputs(arch, resolution, text_len, 1, torch.device("cpu"))
        out = step_peak(adapter, model, params, latents, text, scheduler, LivePeak(), TRAIN_CFG)
    out["at_peak"] = {"base weights": weights, **out["at_peak"]}
    out["peak_bytes"] += weights
    return out


def breakdown(out: dict, top: int = 8) -> dict:
    """The largest groups live at the peak, GiB (for the JSON rows)."""
    return {k: round(v / GIB, 4) for k, v in list(out["at_peak"].items())[:top]}
