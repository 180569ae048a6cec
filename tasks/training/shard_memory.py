"""train.shard=fsdp in the preflight (issue 63): what one of the run's N processes holds, and the shard count validate
names when one card does not fit. The arithmetic of tasks/training/sharding.py's layout (one FSDP2 unit per block of
the family's block lists, the rest of the denoiser one more unit):

- weights per process: 1/N of the whole base as stored (its shard), plus the gathered units: the largest block
  twice (FSDP2 gathers the next unit while this one runs, in forward and backward: two in flight) and the root unit
  whole (reshard_after_forward=False: gathered from the forward to the end of the backward). A gathered unit travels
  in its stored dtype (NF4, fp8) and holds its LoRA's fp32 weights and, in backward, their gradients whole;
- LoRA + gradients + optimizer states (+ EMA): 1/N (they sit in the units, sharded with them);
- activations: the process's share of the batch, ceil(train.batch_size / N) items (as data parallel: each process
  takes its share, tasks/training/batches.py my_share); the transients as without sharding;
- train.shard_offload=true (FSDP2's CPUOffloadPolicy): the shards, the LoRA's and the optimizer's included, wait in
  host memory (the optimizer steps there); the card keeps the gathered units only.

Host memory of one machine (`machine_host`): its L = num_processes / num_machines processes load the base one after
another, each the whole base as stored before it keeps its shard, so loading holds one whole base plus, with the
offload, the shards the earlier processes kept; during the step each process holds the process itself and, with the
offload, its shard.

Not counted: FSDP2's all-gather output buffer, which exists beside the unit's parameters between the gather's end and
its copy-out (issued one unit ahead, so mostly while the previous unit is freed); NF4 weights whose blocks do not
divide by N stay whole on every process (sharding.py logs how many): their other (N-1)/N."""
from __future__ import annotations

import math

GB = 1024 ** 3
SHARD_COUNTS = (2, 4, 8)


def sharded(tc) -> bool:
    return getattr(tc, "shard", "none") == "fsdp"


def items_per_rank(tc) -> int:
    """Items one process runs a micro-batch: its share of train.batch_size (the first processes take one more)."""
    return math.ceil(tc.batch_size / max(1, int(tc.num_processes or 1)))


def units(shapes: dict, per_weight: dict, lists: tuple, lora_per_unit) -> tuple[list[float], float]:
    """(bytes of each block as gathered, bytes of the root unit): stored weights plus the LoRA's fp32 weights
    (`lora_per_unit(shapes of the unit)` parameters) and their gradients in backward."""
    groups: dict[str, dict] = {}
    for k, s in shapes.items():
        parts = k.split(".")
        unit = ".".join(parts[:2]) if parts[0] in lists and len(parts) > 2 and parts[1].isdigit() else ""
        groups.setdefault(unit, {})[k] = s

    def size(members: dict) -> float:
        return sum(per_weight[k] for k in members) + 8.0 * lora_per_unit(members)
    root = groups.pop("", {})
    return [size(m) for m in groups.values()], size(root)


def per_rank(est: dict, tc, shapes: dict, per_weight: dict, lists: tuple, lora_per_unit) -> dict:
    """The estimate `est` (one process holding everything; activations already at its share of the batch) as one of
    N processes holds it with train.shard=fsdp: weights, LoRA + optimizer and host per the module doc, the total again;
    with the sharding's own figures (`shards`, `shard_gb`, `gathered_gb`, `largest_unit_gb`, `root_unit_gb`,
    `allgather_gb` / `reduce_scatter_gb` per process and micro-batch)."""
    n = max(1, int(tc.num_processes or 1))
    if n == 1:  # one process shards nothing (validate refuses train.shard=fsdp with train.num_processes=1)
        return est
    blocks, root = units(shapes, per_weight, lists, lora_per_unit)
    largest = max(blocks, default=0.0)
    whole = est["weights_gb"] * GB
    shard, gathered = whole / n, 2 * largest + root
    lora = est["lora_and_optimizer_gb"] * GB / n
    host = est["host_gb"] * GB
    if tc.shard_offload:
        host += shard + lora
        weights, lora = gathered, 0.0
    else:
        weights = shard + gathered
    total = weights + lora + (est["activations_gb"] + est["transient_gb"]) * GB
    moved = (n - 1) / n
    return {**est, "weights_gb": weights / GB, "lora_and_optimizer_gb": lora / GB, "total_gb": total / GB,
            "host_gb": host / GB, "shards": n, "shard_gb": shard / GB, "gathered_gb": gathered / GB,
            "largest_unit_gb": largest / GB, "root_unit_gb": root / GB, "unsharded_weights_gb": whole / GB,
            "units": len(blocks) + 1,
            # each block gathered in forward and again in backward, the root once (kept for the step); the LoRA's
            # gradients (fp32) reduce-scattered; a ring moves (N-1)/N of each per process
            "allgather_gb": (2 * sum(blocks) + root) * moved / GB,
            "reduce_scatter_gb": est["lora_params"] * 4 * moved / GB}


def machine_host(cfg, est: dict, loading: float, process_gb: float) -> dict:
    """host_memory.host_need for a sharded run: one machine's RAM (module doc), GiB; `process_gb`: one process's own
    (host_memory.PROCESS_GB)."""
    tc = cfg.train
    local = max(1, int(tc.num_processes) // max(1, int(tc.num_machines or 1)))
    per_process = est["host_gb"]  # with shard_offload: the shard and the LoRA's states; the activation offload's
    whole = est.get("unsharded_weights_gb", est["weights_gb"]) + est["lora_params"] * 4 / GB
    offloaded = est.get("shard_gb", 0.0) if tc.shard_offload else 0.0
    during_load = local * process_gb + whole + loading + (local - 1) * offloaded
    during_step = local * (process_gb + per_process)
    return {"host_need_gb": max(during_load, during_step), "host_loading_gb": loading,
            "host_machine_processes": local, "host_during_load_gb": during_load, "host_during_step_gb": during_step}


def remedies(cfg, base: tuple) -> tuple:
    """The preflight's remedies for this run: over N processes the smallest batch is N (one item each), not 1; a
    sharded run has no int8 (it cannot shard; blocks are not swapped either: preflight's max_swap 0) and may keep its
    shards on the host (train.shard_offload=true, tried alone). `base`: memory.REMEDIES."""
    n = max(1, int(cfg.train.num_processes or 1))
    out = tuple((f"train.batch_size={n}", key, n) if key == ("train", "batch_size") else (said, key, value)
                for said, key, value in base)
    if not sharded(cfg.train):
        return out
    return (*(r for r in out if r[2] != "int8"), ("train.shard_offload=true", ("train", "shard_offload"), True))


def nothing_fits(cfg) -> str | None:
    """The refusal's words when no remedy fits a sharded run (None: a run on one card, the preflight's own)."""
    if not sharded(cfg.train):
        return None
    n = cfg.train.num_processes
    return (f"nothing in train.gradient_checkpointing (+_offload), train.optimizer=adamw8bit, model.quantize=fp8|nf4, "
            f"train.shard_offload=true or train.batch_size={n} fits {n} GPUs of this size: use more GPUs, a smaller "
            "data.resolution or bigger devices")


def shard_changes(cfg, adapter, n: int) -> dict | None:
    """The overrides that make `cfg` a sharded run over n processes (the settings validate refuses with fsdp set
    to what shards), or None where it cannot shard (tasks/training/sharding.py errors)."""
    from tasks.config import stored_as, updated
    from tasks.training import sharding, w8a8

    tc, mc = cfg.train, cfg.model
    if tc.num_machines > 1 and n % tc.num_machines:
        return None
    changes = {"train.shard": "fsdp", "train.num_processes": n}
    if tc.batch_size < n:
        changes["train.batch_size"] = n  # each process takes at least one item
    if tc.blocks_to_swap:
        changes["train.blocks_to_swap"] = 0
    if stored_as(mc) == "int8":
        changes.update({"model.quantize": "fp8", "model.storage_dtype": None})
    if stored_as(mc) and w8a8.resolve(mc) != "dequantize":
        changes["model.matmul"] = "dequantize"
    if tc.compile:
        changes["train.compile"] = False
    if int(cfg.sample.every_n_steps) > 0:
        changes["sample.every_n_steps"] = 0
    return None if sharding.errors(updated(cfg, changes), adapter) else changes


def _said(cfg, changes: dict) -> str:
    def now(key):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items()
                    if v is not None and now(k) != v)


def fitting_shards(cfg, adapter, budget_gb: float, estimate_fn, offload: bool = False) -> tuple | None:
    """(the settings, N, the estimate) of the smallest shard count in SHARD_COUNTS (above the run's own when it
    shards already) whose per-process estimate fits the budget: at the run's settings, else with checkpointing;
    `offload`: with train.shard_offload=true too."""
    from tasks.config import updated

    tc = cfg.train
    if not adapter.swap_blocks:
        return None
    above = tc.num_processes if sharded(tc) else 1
    extra = [{}] + ([] if tc.gradient_checkpointing else [{"train.gradient_checkpointing": True}])
    extra = [{**e, "train.shard_offload": True} for e in extra] if offload else extra
    for n in (c for c in SHARD_COUNTS if c > above):  # the fewest GPUs first
        for more in extra:
            changes = shard_changes(updated(cfg, more), adapter, n)
            if changes is None:
                continue
            changes = {**changes, **more}
            est = estimate_fn(updated(cfg, changes))
            if est["total_gb"] <= budget_gb:
                return _said(cfg, changes), n, est
    return None


def hint(cfg, adapter, budget_gb: float, estimate_fn) -> str:
    """validate's words for the shard count that fits ("" where none does), beside the single-card remedies; and,
    where fewer GPUs fit with the shards on the host (train.shard_offload=true: slower), that count too."""
    found = fitting_shards(cfg, adapter, budget_gb, estimate_fn)
    off = None if cfg.train.shard_offload else fitting_shards(cfg, adapter, budget_gb, estimate_fn, offload=True)
    out = []
    for f in (found, off if off and (found is None or off[1] < found[1]) else None):
        if f is not None:
            said, n, est = f
            host = f", {est['host_gb']:.1f} GiB of host memory each" if "shard_offload=true" in said or \
                cfg.train.shard_offload else ""
            out.append(f"{said} ({n} GPUs of this size: {est['total_gb']:.1f} GiB each{host})")
    return f"; over {'more ' if sharded(cfg.train) else ''}GPUs: " + "; or ".join(out) if out else ""
