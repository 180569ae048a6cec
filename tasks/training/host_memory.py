"""The host side of the preflight (issue 43): with a GPU, what training holds in host RAM is the process itself,
the swapped blocks' weights and the offloaded block inputs (the estimate's host_gb), and what loading holds at
its peak: one tensor read and cast on its way to the device when the base is streamed
(tasks/models/loading/stream_load.py), the whole base in the compute dtype on the "bf16-then-quantize" path (DoRA on a
stored base). Without a GPU the device is the host and the device preflight (memory.preflight) already checks
the whole run against the available RAM.

A run that does not fit the host is refused by validate before anything is loaded, with one line naming what
would fit: fewer swapped blocks on a more quantized base, or the activations kept on the device."""
from __future__ import annotations

from pathlib import Path

from tasks.config import Config, ConfigError, stored_as, updated

GB = 1024 ** 3
# The process before loading: Python, torch, diffusers, peft, CUDA's host-side runtime. bench/load.json measured
# 0.47 GiB before loading on the CPU; CUDA's runtime adds about as much again on a GPU machine (rounded up).
PROCESS_GB = 1.5


def loading_gb(cfg: Config, shapes: dict[str, list[int]], file_bytes: dict[str, int]) -> float:
    """Host bytes loading holds at its peak (see the module doc): streamed, the largest tensor as read plus its
    copy in the compute dtype (fp32 where an fp8 file's scale is applied); else the whole base in that dtype."""
    compute = 4 if cfg.model.dtype == "float32" else 2
    numels = {k: _numel(s) for k, s in shapes.items()}
    if stored_as(cfg.model) and cfg.train.network == "dora":
        return sum(numels.values()) * compute / GB
    largest = max(numels, key=numels.get, default=None)
    if largest is None:
        return 0.0
    return (file_bytes.get(largest, 0) + numels[largest] * 4) / GB


def host_need(cfg: Config, estimate: dict, loading: float) -> dict:
    if cfg.train.shard == "fsdp":  # one machine's processes, loading one after another (tasks/training/shard_memory.py)
        from tasks.training.shard_memory import machine_host
        return machine_host(cfg, estimate, loading, PROCESS_GB)
    need = PROCESS_GB + estimate["host_gb"] + loading
    return {"host_need_gb": need, "host_loading_gb": loading}


def check(cfg: Config, estimate: dict, loading: float, available_gb: float, source: str, estimate_for,
          max_swap: int) -> dict:
    """host_need for this run; raises ConfigError (one line) when it exceeds `available_gb`, naming what fits."""
    need = host_need(cfg, estimate, loading)
    if need["host_need_gb"] <= available_gb:
        return need
    hint = _fitting(cfg, available_gb, estimate["budget_gb"], estimate_for, loading, max_swap)
    raise ConfigError(
        f"training will not fit in host memory: about {need['host_need_gb']:.1f} GiB of RAM needed (swapped blocks and "
        f"offloaded activations {estimate['host_gb']:.1f}, loading {loading:.1f}, the process {PROCESS_GB:.1f}) > "
        f"{available_gb:.1f} GiB ({source}); " + (f"would fit: {hint}" if hint else
                                                  "use a smaller data.resolution or a machine with more RAM"))


def _fitting(cfg: Config, host_gb: float, device_gb: float | None, estimate_for, loading: float,
             max_swap: int) -> str | None:
    """The first setting that fits both the device and the host: the least quantized base first (a more quantized
    one shrinks the swapped blocks), then the fewest blocks swapped, without the activation offload first."""
    swap = cfg.train.blocks_to_swap or 0
    offload = bool(cfg.train.gradient_checkpointing_offload)
    current = stored_as(cfg.model) or "none"
    kinds = [k for k in ("none", "fp8", "int8", "nf4") if _rank(k) >= _rank(current)
             and not (k == "int8" and cfg.train.shard == "fsdp")]  # int8 cannot shard
    for kind in kinds:
        for off in ([False, True] if offload else [False]):
            for n in range(0, max_swap + 1):
                changes = [(f"model.quantize={kind}", ("model", "quantize"), kind),
                           (f"train.blocks_to_swap={n}", ("train", "blocks_to_swap"), n)]
                if offload:
                    changes.append((f"train.gradient_checkpointing_offload={str(off).lower()}",
                                    ("train", "gradient_checkpointing_offload"), off))
                c = _with(cfg, changes)
                est = estimate_for(c)
                if device_gb is not None and est["total_gb"] > device_gb:
                    continue
                host = host_need(c, est, loading)["host_need_gb"]
                if host <= host_gb:
                    said = [x[0] for x, v in zip(changes, ((current != kind), n != swap, off != offload)) if v]
                    return " ".join(said) + f" ({est['total_gb']:.1f} GiB on the device, {host:.1f} GiB RAM)"
    return None


def _with(cfg: Config, changes: list[tuple]) -> Config:
    new = updated(cfg, {f"{section}.{key}": value for _, (section, key), value in changes})
    # one way to store the base (validate refuses both)
    return updated(new, {"model.storage_dtype": None}) if new.model.quantize != "none" else new


def _rank(kind: str) -> int:
    return {"none": 0, "fp8": 1, "int8": 2, "nf4": 3}[kind]


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def preflight(cfg: Config, adapter, size: tuple[int, int], estimate: dict, cuda: bool | None = None,
              available: tuple[float, str] | None = None) -> dict:
    """validate's host check (module doc): reads the denoiser files' headers (a missing or truncated file is a
    one-line ConfigError here, before anything is cached or loaded); with a GPU, refuses a run the RAM cannot
    hold. Returns the report's host figures."""
    from tasks.models.loading.stream_load import folder_entries
    from tasks.runtime import cuda_available
    from tasks.training.memory import block_order, estimate as estimate_of, family_factors, host_available_gb, lora_targets

    folders = [adapter.model_dir / f for f in (adapter.experts.values() if adapter.denoisers > 1
                                                 else (adapter.denoiser_subfolder,))]
    entries = {k: e for f in folders for k, e in folder_entries(Path(f)).items()}
    shapes = {k: list(e.shape) for k, e in entries.items()}
    loading = loading_gb(cfg, shapes, {k: e.end - e.start for k, e in entries.items()})
    matrices = [e for k, e in entries.items() if k.endswith(".weight") and len(e.shape) == 2]
    if not stored_as(cfg.model) and sum(e.dtype.startswith("F8") for e in matrices) * 2 >= max(1, len(matrices)):
        import logging

        logging.getLogger(__name__).warning(
            "validate: the base's weights are stored in fp8; model.quantize=none trains on them upcast to "
            "model.dtype (twice the bytes): model.quantize=fp8 holds them as stored")
    if not (cuda_available() if cuda is None else cuda):
        return host_need(cfg, estimate, loading)
    targets = lora_targets(cfg.train, adapter)

    def estimate_for(c):
        return estimate_of(c, adapter.model_dir, adapter.denoiser_subfolder, targets, size,
                           c.model.max_sequence_length, adapter.denoiser_cls if stored_as(c.model) else None,
                           adapter.swap_blocks, adapter.denoisers, geometry=adapter.activation_geometry,
                           factors=family_factors(adapter))

    blocks = 0 if cfg.train.shard == "fsdp" else adapter.denoisers * len(block_order(shapes, adapter.swap_blocks))
    gb, source = available or host_available_gb()
    return check(cfg, estimate, loading, gb, source, estimate_for, blocks)
