"""How the train node loads the frozen base (issue 43): streamed tensor by tensor (tasks/models/loading/stream_load.py),
each frozen weight stored as `model.quantize` says (fp8 / torchao int8 / NF4, or bitsandbytes' NF4 where
model.matmul resolves to bnb) the moment it is read, on the GPU
where there is one; a swapped block's weights (train.blocks_to_swap) straight to the host.

The stored weights are held here, not in the module, until peft has added the LoRA layers: peft casts a new
LoRA layer to its base weight's dtype (fp8 would round the LoRA's initial values) and gives torchao weights its
own LoRA class. So the module gets a one-element placeholder of the weight's shape in the compute dtype while
peft wraps it, and `attach` puts the stored weight in its place before quantize_base / store_base_low register
their hooks, which then find the weight stored already. The result equals the bf16-then-quantize path bit for
bit (tests/test_stream_load.py): the same bf16 values (cast as from_pretrained casts) are quantized by the same
function on the same device.

DoRA reads the base weight when peft adds it (its magnitude is the weight's norm): with it the base loads in the
compute dtype on the host and is stored low afterwards, as before ("bf16-then-quantize")."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tasks.config import Config, stored_as
from tasks.lazy import lazy
from tasks.training import w8a8

torch = lazy("torch")


@dataclass
class WeightLoading:
    """tasks.models.bases.adapter.FamilyAdapter.weight_loading: what stream_load calls per weight and where it puts it."""
    kind: str | None  # fp8 dtype name, int8, nf4; None: the compute dtype
    skip: tuple[str, ...]
    device: str
    matmul: str = "dequantize"  # model.matmul resolved (w8a8.resolve): bnb stores nf4 in bitsandbytes' format
    swapped: dict[str, tuple[str, ...]] = field(default_factory=dict)  # subfolder -> prefixes held on the host
    held: dict = field(default_factory=dict)  # module -> its stored weight, until attach

    def place(self, subfolder: str, name: str) -> str:
        return "cpu" if name.startswith(self.swapped.get(subfolder, ("\0",))) else self.device

    def store(self, path: str, module, value):
        from tasks.training.fp8_base import castable, skipped
        from tasks.training.quantized_base import quantize_weight

        if self.kind is None or skipped(path, self.skip):
            return None
        if self.kind in ("int8", "nf4"):
            stored = quantize_weight(value, self.kind, self.matmul) if isinstance(module, torch.nn.Linear) else None
        else:
            stored = value.to(getattr(torch, self.kind)) if castable(module) else None
        if stored is None:
            return None
        self.held[module] = stored
        return torch.zeros((), dtype=value.dtype, device=value.device).expand(value.shape)

    def attach(self, model) -> int:
        """Each held weight into its module (peft keeps the original Linear as its base_layer); returns how many."""
        n = 0
        for module in model.modules():
            stored = self.held.pop(module, None)
            if stored is not None:
                module._parameters["weight"] = torch.nn.Parameter(stored, requires_grad=False)
                n += 1
        if self.held:
            raise RuntimeError(f"{len(self.held)} stored weights found no module")  # a bug, not a user error
        return n


def plan_loading(adapter, cfg: Config, skip: tuple[str, ...]) -> WeightLoading | None:
    """The train node's loading plan for this config (see the module doc); None: from_pretrained whole in the
    compute dtype on the host, stored low afterwards (the path named "bf16-then-quantize")."""
    stored = stored_as(cfg.model)
    # train.shard=fsdp: into host memory; FSDP2 moves each block to the GPU as it shards it (a base that needs
    # sharding fits no single card whole)
    device = "cuda" if torch.cuda.is_available() and cfg.train.shard != "fsdp" else "cpu"
    if stored and cfg.train.network == "dora":
        return None
    plan = WeightLoading(stored or None, skip, device, w8a8.resolve(cfg.model))
    n = cfg.train.blocks_to_swap or 0
    if n and adapter.denoisers == 1:  # Wan 2.2's two experts: placed whole, swap_blocks moves theirs after
        from tasks.models.loading.stream_load import folder_entries
        from tasks.training.memory import block_order

        shapes = {k: e.shape for k, e in folder_entries(adapter.model_dir / adapter.denoiser_subfolder).items()}
        order = block_order(shapes, adapter.swap_blocks)  # more than there are: swap_blocks refuses it later
        plan.swapped[adapter.denoiser_subfolder] = tuple(f"{name}.{i}." for name, i in order[max(0, len(order) - n):])
    return plan


def loading_path(plan: WeightLoading | None) -> str:
    return "bf16-then-quantize" if plan is None else "stream"


def load_planned(adapter, plan: WeightLoading | None, load: Callable):
    """`load()` (the adapter's load_denoiser) with the plan set on the adapter for its duration."""
    adapter.weight_loading = plan
    try:
        return load()
    finally:
        adapter.weight_loading = None
