"""What bench.memory's method counts, on fake tensors: the storages autograd saves in a training step
(SavedTensors, count_step; each storage once, parameters out), a model's parameters made fake (to_fake), and a
header-only model folder the preflight reads (model_headers). Shared by bench.memory, bench.memory_families and
bench.memory_peak; imports none of them."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path


def storage_key(t):
    """One key per storage: views of one storage share it."""
    return t.untyped_storage()._cdata


class SavedTensors:
    """Distinct storages autograd saves (outer hook) and those each checkpoint recompute saves, parameters out."""

    def __init__(self, model):
        self.params = {storage_key(p) for p in model.parameters()}
        self.saved: dict[int, int] = {}  # storage -> bytes
        self.keep: list = []  # keeps storages alive while counted, so no key is reused
        self.recomputes: list[int] = []

    def _add(self, t, into: dict) -> None:
        k = storage_key(t)
        if k not in self.params and k not in self.saved and k not in into:
            into[k] = t.untyped_storage().nbytes()
            self.keep.append(t)

    def hooks(self):
        from torch.autograd.graph import saved_tensors_hooks

        def pack(t):
            self._add(t, self.saved)
            return t  # kept as autograd would keep it: counting changes nothing
        return saved_tensors_hooks(pack, lambda t: t)

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


def to_fake(model, params, mode) -> list:
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


def count_step(adapter, model, params, latents, text, scheduler) -> tuple[int, int, int]:
    """(LoRA gradient bytes, bytes autograd saves, the largest recompute's) of one bf16-autocast step."""
    import torch

    from bench.flux_train import TRAIN_CFG

    counter = SavedTensors(model)
    with counter.hooks(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = adapter.training_loss(model, latents, text, TRAIN_CFG, scheduler, [torch.Generator().manual_seed(0)])
    with counter.recompute_hooks():
        loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return grads, counter.total, max(counter.recomputes, default=0)


def model_headers(model, folder: Path) -> Path:
    """`folder`/transformer: the model's config.json and a header-only safetensors file of its bf16 shapes."""
    sub = Path(folder) / "transformer"
    sub.mkdir(parents=True, exist_ok=True)
    # _class_name as in a real folder: the preflight finds the family's own constants by it
    (sub / "config.json").write_text(json.dumps({**dict(model.config), "_class_name": type(model).__name__},
                                                default=list))
    header, offset = {}, 0
    for name, t in model.state_dict().items():
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + t.numel() * 2]}
        offset += t.numel() * 2
    raw = json.dumps(header).encode()
    (sub / "diffusion_pytorch_model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    return Path(folder)
