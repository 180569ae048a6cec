"""The big bases of bench.memory's family rows (`<model>:<options>`): each model's adapter with random weights at
its real architecture (random_adapter), its training geometry and one batch of cached inputs (batch_inputs), the
train config of a row's options (parse, train_config) and the bytes its base weights take as stored (weights).
Shared by bench.memory_families and bench.memory_peak; imports neither."""
from __future__ import annotations

import functools
import re
from pathlib import Path

from bench.flux_train import random_model
from tasks.config import Config, config_of

HERE = Path(__file__).resolve().parent


@functools.cache
def declared() -> dict:
    """{row prefix: (family, RealSize)} of every full-size model the registry's families declare (issue 64 item 4:
    a family's knowledge in its own files; tasks/models/bases/real_size.py). Each class's own: a subclass family
    (FLUX.1 Kontext of Flux) does not inherit its parent's models."""
    from tasks.models import FAMILIES, adapter_class

    return {rs.name: (f, rs) for f in FAMILIES for rs in vars(adapter_class(f)).get("real_sizes", ())}


# A model's training geometry where it is not the rows' square resolution: (width, height), frames (tests shrink it)
GEOMETRY = {name: (rs.size, rs.frames) for name, (_, rs) in declared().items() if rs.size}


def geometry(model: str, resolution: int) -> tuple[tuple[int, int], int]:
    return GEOMETRY.get(model, ((resolution, resolution), declared()[model][1].frames if model in declared() else 1))


def model_table() -> dict:
    """{model: (adapter "module:Class", denoiser class name, config values over the class defaults)}."""
    from tasks.models import FAMILIES

    return {name: (FAMILIES[f][0], rs.denoiser, rs.arch) for name, (f, rs) in declared().items()}


def parse(options: str) -> dict:
    parts = options.split("+")
    swap = next((int(p[4:]) for p in parts if re.fullmatch(r"swap\d+", p)), 0)
    # +fsdpN: train.shard=fsdp over N processes, batch N (one item each); +shardoffload: train.shard_offload (issue 63)
    shards = next((int(p[4:]) for p in parts if re.fullmatch(r"fsdp\d+", p)), 1)
    return {"store": parts[0], "ckpt": "ckpt" in parts, "swap": swap, "offload": "offload" in parts,
            "shards": shards, "shard_offload": "shardoffload" in parts}


def random_adapter(model: str, device):
    import importlib

    import diffusers

    ref, cls_name, arch = model_table()[model]
    module, name = ref.split(":")
    base = getattr(importlib.import_module(module), name)
    cls = getattr(diffusers, cls_name)

    class Random(base):
        # Wan 2.2's experts: the switch is read from model_index.json (there is none here), and an expert redraws a
        # timestep off its side (a data-dependent branch fake tensors cannot take); memory is the same on either side
        boundary = 900.0

        def _mine(self, t) -> bool:
            return True

        def load_denoiser(self):  # random bf16 weights on `device` (meta: shapes only); no file
            return random_model(cls, arch, device)

    return Random(HERE, "bfloat16"), cls, arch


def batch_inputs(model: str, config: dict, resolution: int, text_len: int):
    """One cached item's (latents, text) at the model's geometry: the family's own shapes (FamilyAdapter.bench_batch)."""
    from tasks.models import adapter_class

    size, frames = geometry(model, resolution)
    return adapter_class(declared()[model][0]).bench_batch(config, size, frames, text_len)


def train_config(opts: dict, text_len: int, rank: int, frames: int = 1) -> Config:
    store = opts["store"]
    return config_of({
        "data": {"frames": frames},
        "model": {"dtype": "bfloat16", "storage_dtype": None, "storage_modulation": False,
                  "quantize": store if store in ("fp8", "int8", "nf4") else "none", "max_sequence_length": text_len},
        "train": {"rank": rank, "alpha": None, "target_modules": None, "batch_size": 1, "optimizer": "adamw",
                  "mixed_precision": "bf16", "gradient_checkpointing": opts["ckpt"], "blocks_to_swap": opts["swap"],
                  "gradient_checkpointing_offload": opts.get("offload", False),
                  **({"shard": "fsdp", "num_processes": opts["shards"], "batch_size": opts["shards"],
                      "shard_offload": opts.get("shard_offload", False)} if opts.get("shards", 1) > 1 else {})}})


@functools.lru_cache(maxsize=64)
def quantized_bytes(shape: tuple, store: str) -> int:
    """Bytes of torchao's tensor for a bf16 weight of this shape (real random values, quantized here)."""
    import torch

    from tasks.training.block_swap import stored_nbytes
    from tasks.training.quantized_base import quantize_weight

    q = quantize_weight(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16), store)
    return stored_nbytes(q) if q is not None else 2 * torch.Size(shape).numel()


def stored_size(module, name: str, p, path: str, store: str, skip) -> int:
    """Bytes of one parameter as training stores it with `store` (bf16 | fp8 | int8 | nf4): torchao's own tensors' for
    a quantized Linear weight, one a value for fp8, else bf16's two."""
    import torch

    from tasks.training.fp8_base import CASTABLE, skipped

    if name == "weight" and isinstance(module, CASTABLE) and not skipped(path, skip):
        if store in ("int8", "nf4") and isinstance(module, torch.nn.Linear):
            return quantized_bytes(tuple(p.shape), store)
        if store == "fp8":
            return p.numel()
    return p.numel() * 2


def weights(model: str, opts: dict) -> dict:
    """(device bytes, host bytes) of the base weights as training holds them with these options."""
    import torch

    from tasks.training.block_swap import blocks
    from tasks.training.fp8_base import CASTABLE
    from tasks.training.memory import layerwise_skip_patterns

    adapter, cls, _ = random_adapter(model, torch.device("meta"))
    den = adapter.load_denoiser()
    store, skip = opts["store"], layerwise_skip_patterns(cls, False)
    swapped = {id(m) for b in blocks(den, adapter.swap_blocks)[len(blocks(den, adapter.swap_blocks)) - opts["swap"]:]
               for m in b.modules()} if opts["swap"] else set()
    device = host = in_flight = 0
    for path, module in den.named_modules():
        for name, p in module.named_parameters(recurse=False):
            size = stored_size(module, name, p, path, store, skip)
            if name == "weight" and isinstance(module, CASTABLE) and id(module) in swapped:
                host += size
                in_flight = max(in_flight, p.numel() * 2)
            else:
                device += size
    return {"device": device + in_flight, "host": host, "in_flight": in_flight}
