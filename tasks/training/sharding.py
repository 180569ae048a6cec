"""train.shard=fsdp: the frozen base sharded over the run's processes with torch's FSDP2 (`fully_shard`), for a
base too big for one card (docs/scaling.md).

Each repeated block the family declares (`adapter.swap_blocks`: Flux's double and single blocks, Wan's blocks ...)
is its own FSDP2 unit: gathered for its forward, freed after it, gathered again for its backward (with gradient
checkpointing its recompute runs inside that gather). The rest of the denoiser (embedders, final layers) is one
more unit, gathered for the whole step. The LoRA sits in those units, so its weights, gradients and AdamW moments
are sharded too; it trains in fp32 as without sharding.

accelerate's FSDP plugin is not used: without CUDA it silently trains data parallel (the suite's gloo runs must
shard as a GPU run does), and `prepare` would wrap the denoiser, which the adapters call directly. No sharding is
written here: torch's fully_shard does it, and torchao's NF4 tensor brings its own split and gather.

Kept from the data-parallel path: each process's loss is weighted by its share of the batch and the gradients
are *summed* over processes (FSDP2 averages by default: sum reduction forced, divide factor 1), so both paths do
the same maths (tests/test_shard.py)."""
from __future__ import annotations

import logging
from datetime import timedelta

from tasks.config import Config, stored_as
from tasks.lazy import lazy
from tasks.training import w8a8

torch = lazy("torch")
log = logging.getLogger("loraflow")


# How long a process waits in a collective: the first to load its shard waits for the others to load theirs in turn
# (a 32 B base from disk, one process after another), far beyond the 10-minute default of nccl's watchdog
WAIT = timedelta(hours=2)


def sharded(cfg: Config) -> bool:
    return cfg.train.shard == "fsdp"


def errors(cfg: Config, adapter_cls) -> list[str]:
    """What cannot shard, refused by validate (one line each, naming the key and the fix)."""
    tc = cfg.train
    if tc.shard != "fsdp":
        return ["train.shard_offload=true keeps the shards of train.shard=fsdp on the host: set train.shard=fsdp "
                "too (or drop the offload)"] if tc.shard_offload else []
    out = []
    if tc.num_processes < 2:
        out.append(f"train.shard=fsdp with train.num_processes={tc.num_processes}: the base is sharded over the "
                   "run's processes, one per GPU; set train.num_processes=2 or more (or train.shard=none)")
    if not adapter_cls.swap_blocks:
        out.append(f"train.shard=fsdp: model.family={cfg.model.family} declares no repeated blocks to shard (its "
                   "base fits one card); use train.shard=none")
    why = {"blocks_to_swap": (tc.blocks_to_swap, "the shards are the blocks' weights; use train.shard_offload=true "
                                                 "to keep them on the host"),
           "network": (tc.network if tc.network != "lora" else 0, "only a plain LoRA is sharded and tested; use "
                                                                  "train.network=lora"),
           "text_encoder_lr": (tc.text_encoder_lr, "the text encoders' LoRA is not sharded; set it to null"),
           "compile": (tc.compile, "regional compile of sharded blocks is not tested; set train.compile=false")}
    out += [f"train.{k}={v} with train.shard=fsdp: {fix}" for k, (v, fix) in why.items() if v]
    if cfg.model.expert == "both":
        out.append("model.expert=both with train.shard=fsdp: the two experts share one LoRA's parameters, which "
                   "one FSDP unit each cannot hold; train one expert a run (-m model.expert=high,low)")
    stored = stored_as(cfg.model)
    if stored == "int8":  # torchao's Int8Tensor has no split for FSDP2 (aten.split / new_zeros)
        out.append("model.quantize=int8 with train.shard=fsdp: torchao's int8 tensor cannot be sharded; use "
                   "model.quantize=nf4 or fp8 (both shard), or train.shard=none")
    matmul = w8a8.resolve(cfg.model) if stored else "dequantize"
    if matmul != "dequantize":  # bitsandbytes' NF4 and the w8a8 path read their own weight formats
        out.append(f"model.matmul={cfg.model.matmul} (resolved: {matmul}) with train.shard=fsdp: only the "
                   "dequantizing matmul runs on sharded weights (torchao's NF4 shards); set model.matmul=dequantize")
    if int(cfg.sample.every_n_steps) > 0:
        out.append(f"sample.every_n_steps={cfg.sample.every_n_steps} with train.shard=fsdp: samples during a sharded "
                   "run are not made (every process would render); set sample.every_n_steps=0: the sample node "
                   "renders the finished LoRA")
    return out


def _nf4_shardable(weight, world: int) -> bool:
    """torchao's NF4 tensor splits along its rows when every inner tensor divides evenly (its aten.split)."""
    return weight.size(0) % world == 0 and all(getattr(weight, a).numel() % world == 0 for a in
                                               ("quantized_data", "quantized_scalers", "quantization_factor"))


def _unshardable(module, world: int) -> set:
    """Frozen weights FSDP2 cannot split (an NF4 weight whose blocks do not divide by the world size): kept whole on
    every process (FSDP2's ignored_params), named in the log."""
    return {p for p in module.parameters() if type(p.data).__name__ == "NF4Tensor" and not _nf4_shardable(p, world)}


def blocks(denoiser, lists: tuple[str, ...]) -> list:
    return [b for name in lists for b in denoiser.get_submodule(name)]


def shard_denoiser(denoiser, adapter, mesh, device, offload: bool = False) -> dict:
    """Shards `denoiser` in place over `mesh` (all processes): one FSDP2 unit per block of the family's block
    lists, the root one more. Returns what the report says of it. Build the optimizer after this: the
    parameters are replaced by sharded DTensors."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    world = mesh.size()
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    units, kept = blocks(denoiser, adapter.swap_blocks), set()
    for block in units:
        ignored = _unshardable(block, world)
        kept |= ignored
        fully_shard(block, mesh=mesh, reshard_after_forward=True, offload_policy=policy, ignored_params=ignored or None)
    inside = {p for b in units for p in b.parameters()}
    root_ignored = kept | _unshardable(denoiser, world) - inside
    kept |= root_ignored
    # the root's own weights (embedders, final layers) stay gathered from forward to backward: they are used at
    # both ends of the step
    fully_shard(denoiser, mesh=mesh, reshard_after_forward=False, offload_policy=policy,
                ignored_params=root_ignored or None)
    for unit in (*units, denoiser):
        unit.set_force_sum_reduction_for_comms(True)  # sum, as the data-parallel path sums
        unit.set_gradient_divide_factor(1.0)
    with torch.no_grad():  # the whole weights FSDP2 leaves alone go to the device themselves
        for p in kept:
            p.data = p.data.to(device)
    if kept:
        log.info("train: %d NF4 weight(s) kept whole on every process (their blocks do not divide by %d)",
                 len(kept), world)
    for b in denoiser.buffers():
        b.data = b.data.to(device)
    return {"units": len(units) + 1, "processes": world, "kept_whole": len(kept), "offload": offload}


def full(t):
    """The whole tensor of a sharded one (a collective: every process calls it, in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assign(dst, whole) -> None:
    """dst (a parameter or optimizer state, sharded or not) takes the values of the whole tensor `whole`, which
    every process has (read from the store): each keeps its own shard, with no communication."""
    if hasattr(dst, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        part = distribute_tensor(whole.to(dst.device, dst.dtype), dst.device_mesh, dst.placements,
                                 src_data_rank=None)
        dst.to_local().copy_(part.to_local())
    else:
        dst.copy_(whole)


def like(param, whole):
    """An optimizer state tensor for `param` from its whole value: sharded as `param` is."""
    if hasattr(param, "device_mesh") and whole.dim():
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return whole.to(param.device) if whole.dim() else whole


def full_lora_state(holder, values: dict | None = None) -> dict:
    """The LoRA's peft state dict, whole (on every process: the gather is collective). `values`: name ->
    tensor to write instead of the parameters (the EMA's), keyed as holder.named_parameters()."""
    from peft.utils import get_peft_model_state_dict

    whole = {n: full(values[n] if values is not None else p).detach().cpu()
             for n, p in holder.named_parameters() if p.requires_grad}
    return get_peft_model_state_dict(holder, state_dict=whole)


def load_sharded(accelerator, load, adapter, offload: bool) -> tuple:
    """(denoiser, {name: trainable parameter}, what the report says of the sharding). The processes of one machine
    load the base one after another (`load`: the frozen base with its LoRA, on the host) and each shards it before
    the next starts, so a machine holds one whole base at a time, not one per process."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    device = accelerator.device
    mesh = init_device_mesh(device.type, (accelerator.num_processes,))  # every process together, before the turns
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    denoiser = info = None
    for turn in range(local):
        if accelerator.local_process_index == turn:
            denoiser = load()
            info = shard_denoiser(denoiser, adapter, mesh, device, offload)
        accelerator.wait_for_everyone()
    # the parameters are sharded DTensors now: the trained ones named again (the optimizer is built on these)
    return denoiser, {n: p for n, p in denoiser.named_parameters() if p.requires_grad}, info


def agreed(signum: int, device) -> int:
    """A stop requested on any process, seen by all (each stops after the same step)."""
    import torch.distributed as dist

    flag = torch.tensor([signum], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
