"""Preflight memory estimate for the train node: weights, LoRA + optimizer states and activations at the
chosen size and batch, against the memory the device has free. Read from the denoiser's config and
safetensors headers (no weights loaded). When it will not fit, the message names the settings that
would make it fit.

The activation term is linear in tokens x width per block, with constants measured by `python -m bench.memory`
on FLUX.1-dev (bf16 autocast, rank 16, 1024 and 512 px + 512 text tokens; bench/memory.json): what autograd
saves, counted from real tensor shapes (Wan's and LTX-2's measured on them likewise, Wan's image-to-video
families' too: each adapter declares them). For SD3 and the UNets the Flux constants are a rule of thumb, not measured. The transient term (gradients in flight, a quantized weight's
dequantize) is measured by bench/memory_peak.py's live-storage count (peak_gib); the CUDA context and fragmentation
are not in it: `bench/gpu.py` measures a GPU's real peak."""
from __future__ import annotations

import functools
import json
import re
import struct
from pathlib import Path
from typing import NamedTuple

from tasks.config import Config, stored_as, updated
from tasks.config_schema import TrainConfig
from tasks.runtime import cuda_available
from tasks.training import shard_memory, w8a8

GB = 1024 ** 3
# Saved values per token x width, measured (bench/memory.json; 1024 px / 512 px):
ACT_FACTOR = 22.6  # per block, no checkpointing: Flux's double/single mean, outside layers included (22.5/22.7)
CKPT_INPUT_FACTOR = 1.03  # per block with checkpointing: its checkpointed inputs, outside layers included (1.034/1.030)
RECOMPUTE_FACTOR = 22.5  # one block's internals while its recompute is held in backward (22.4/22.6)
# A family measured on its own declares its constants on its adapter (`activation_factors`: Wan, LTX-2)
# Transients a GPU's peak (max_memory_allocated) holds beyond what autograd saves, measured by bench.memory_peak
# (live storages over a whole step; issue 43): the gradients in flight inside one block's backward, per token x
# width (FLUX.1-dev bf16+ckpt 13.3, Wan 14B nf4+ckpt 12.1); or, where larger, the dequantize of the largest stored
# Linear in flight, bytes per element inside fp8_base.upcast, its bf16 output included (torchao's NF4 decodes
# through int64 indices; int8 through fp32), at the first block's backward, before the LoRA's gradients exist
TRANSIENT_FACTOR = 13.0
# model.matmul=bnb (nf4_kernel.py): bnb's dequantize_4bit writes the bf16 weight at once (2) from its fp32 block scales
# (4 per 64), no int64 indices; derived from its kernels, not measured (bench.memory_peak sees no bnb op's inside)
UPCAST_BYTES = {"float8_e4m3fn": 2.0, "float8_e5m2": 2.0, "int8": 7.0, "nf4": 14.05, "nf4+bnb": 2.07}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def header_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors headers of a model folder."""
    files = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(Path(folder).glob("*.safetensors")))
    return _headers(files)


@functools.lru_cache(maxsize=8)  # the remedies' search reads one model's headers many times (read-only)
def _headers(files: tuple) -> dict[str, list[int]]:
    shapes = {}
    for file, _, _ in files:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def lora_targets(tc: TrainConfig, adapter) -> list[str] | str:
    """train.target_modules (suffixes) or the family's default (suffixes or one full-path regex)."""
    return list(tc.target_modules) if tc.target_modules else adapter.default_lora_targets()


def lora_params(shapes: dict[str, list[int]], targets: list[str] | str, rank: int) -> int:
    """peft's matching: a module whose name is a target or ends with '.<target>', or, for one string, a
    module whose whole name matches it as a regex."""
    total = 0
    for name, shape in shapes.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        if (re.fullmatch(targets, module) if isinstance(targets, str)
                else any(module == t or module.endswith("." + t) for t in targets)):
            total += rank * (shape[0] + shape[1])
    return total


def layerwise_skip_patterns(denoiser_cls=None, modulation: bool = False) -> tuple[str, ...]:
    """The module-name patterns kept in the compute dtype with an fp8 base: diffusers' layerwise-casting defaults for
    this class (embeddings, norms incl. the AdaLN modulation linears under them, proj_in/proj_out) plus the
    class's own lists. `modulation`: without "norm", so the linears under norm-named modules (the AdaLN
    modulation) are stored low too; the norm layers themselves are never stored low (only Linear and Conv
    weights are: tasks/training/fp8_base.py)."""
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    own = [*(getattr(denoiser_cls, "_keep_in_fp32_modules", None) or ()),
           *(getattr(denoiser_cls, "_skip_layerwise_casting_patterns", None) or ())]
    patterns = tuple(dict.fromkeys((*DEFAULT_SKIP_MODULES_PATTERN, *own)))
    return tuple(p for p in patterns if p != "norm") if modulation else patterns


def stored_weight_bytes(shapes: dict[str, list[int]], dtype: str, storage_dtype: str | None,
                        skip_patterns: tuple[str, ...]) -> int:
    """Bytes of the base weights as training holds them. With a storage dtype (tasks/training/fp8_base.py), the weights
    of the Linear/Conv layers (2+ dims; these denoisers have no nn.Embedding) are stored in it, except under a
    module whose name matches a skip pattern at any level of the path; biases and everything else stay in the
    compute dtype."""
    return round(sum(weight_bytes(shapes, dtype, storage_dtype, skip_patterns).values()))


def weight_bytes(shapes: dict[str, list[int]], dtype: str, storage_dtype: str | None,
                 skip_patterns: tuple[str, ...]) -> dict[str, float]:
    """stored_weight_bytes, per weight."""
    if not storage_dtype:
        return {n: _numel(s) * DTYPE_BYTES[dtype] for n, s in shapes.items()}
    quantized = storage_dtype in ("int8", "nf4")  # Linears only (quantized_base.py): 2-dim weights

    def stored_low(name: str, shape) -> bool:
        if not name.endswith(".weight") or len(shape) < 2 or (quantized and len(shape) != 2):
            return False
        return not _skipped(name.rpartition(".")[0], tuple(skip_patterns))

    return {n: stored_bytes(_numel(s), storage_dtype) if stored_low(n, s) else _numel(s) * DTYPE_BYTES[dtype]
            for n, s in shapes.items()}


@functools.lru_cache(maxsize=1 << 16)
def _skipped(path: str, patterns: tuple[str, ...]) -> bool:
    """Whether a skip pattern matches the module `path` or any module above it. Memoised per path: a block's
    weights share their parents, and the preflight asks for every weight of a 12-32 B model per setting it
    weighs (the card table's advice: tens of thousands of weights, hundreds of settings)."""
    if not path:
        return False
    return _skipped(path.rpartition(".")[0], patterns) or any(p.search(path) for p in _compiled(patterns))


@functools.lru_cache(maxsize=64)
def _compiled(patterns: tuple[str, ...]) -> tuple[re.Pattern, ...]:
    return tuple(re.compile(p) for p in patterns)


def block_order(shapes: dict[str, list[int]], lists: tuple[str, ...]) -> list[tuple[str, int]]:
    """(list, index) of each block of the denoiser's block lists, in run order, from its weights' names."""
    return [(name, i) for name in lists for i in sorted({int(k.split(".")[1]) for k in shapes
                                                         if k.startswith(name + ".") and k.split(".")[1].isdigit()})]


def swapped_weights(shapes: dict[str, list[int]], lists: tuple[str, ...], n: int) -> list[str]:
    """The weights train.blocks_to_swap=n holds on the host: the Linear/Conv weights (2+ dims) of the last n
    blocks of `lists` in run order (block_swap.py)."""
    order = block_order(shapes, lists)
    if n > len(order):
        from tasks.config import ConfigError
        raise ConfigError(f"train.blocks_to_swap={n}: this model has {len(order)} transformer blocks; swap "
                          f"{len(order)} or fewer")
    prefixes = tuple(f"{name}.{i}." for name, i in order[len(order) - n:]) if n else ()
    return [k for k, s in shapes.items() if k.startswith(prefixes) and k.endswith(".weight") and len(s) >= 2] \
        if prefixes else []


def stored_bytes(numel: int, storage: str) -> float:
    """Bytes of a weight of `numel` elements stored as `storage`: an fp8 dtype; int8 (1 a element, its per-row
    scale aside); nf4 (half a byte, an int8 scaler per block of 64, an fp32 factor per 256 blocks)."""
    if storage == "int8":
        return float(numel)
    if storage == "nf4":
        return numel / 2 + numel / 64 + 4 * numel / (64 * 256)
    return float(numel * DTYPE_BYTES[storage])


def activation_factors(config: dict) -> tuple[float, float, float]:
    """(per block, per checkpointed block, one recompute) in saved values per token x width, for this denoiser:
    those its family declares (the adapter whose denoiser class config.json names), else FLUX.1's measured ones."""
    return _declared_factors(config.get("_class_name")) or (ACT_FACTOR, CKPT_INPUT_FACTOR, RECOMPUTE_FACTOR)


class Factors(NamedTuple):
    """A family's activation constants: values saved or held per token x width (a family declares the first three),
    what train.gradient_checkpointing_offload copies to the host per block: `offloaded` per token x width, and
    `text_offloaded` per text token x width where the caption is a block input beside the sequence (cross-attention)."""
    per_block: float  # saved per block, no checkpointing
    ckpt_input: float  # saved per checkpointed block (its inputs; the layers outside the blocks spread over them)
    recompute: float  # one block's internals while its recompute is held in backward
    in_flight: float = TRANSIENT_FACTOR  # what a block's backward holds beyond them (the gradients in flight)
    offloaded: float = 1.0
    text_offloaded: float = 0.0


def family_factors(adapter) -> Factors | None:
    """The activation constants an adapter declares (`activation_factors`, else FLUX.1's, with its
    `activation_extras`, measured by `python -m bench.memory --families`: families that share a denoiser class told
    apart); None where it declares neither (estimate then takes the denoiser class's, activation_factors)."""
    declared, extras = getattr(adapter, "activation_factors", None), getattr(adapter, "activation_extras", {})
    if not declared and not extras:
        return None
    return Factors(*(declared or (ACT_FACTOR, CKPT_INPUT_FACTOR, RECOMPUTE_FACTOR)))._replace(**extras)


@functools.lru_cache(maxsize=None)  # the remedies' search estimates many settings of one model
def _declared_factors(class_name: str | None) -> tuple[float, float, float] | None:
    import inspect

    from tasks.models import FAMILIES, adapter_class

    for family in FAMILIES:
        adapter = adapter_class(family)  # the class's LazyClass name: no diffusers import on a no-op run
        if adapter.activation_factors and inspect.getattr_static(adapter, "denoiser_cls").name == class_name:
            return adapter.activation_factors
    return None


def estimate(cfg: Config, model_dir: Path, denoiser_folder: str, targets: list[str], size: tuple[int, int],
             text_tokens: int, denoiser_cls=None, swap_lists: tuple[str, ...] = (), copies: int = 1, *,
             geometry, factors: Factors | None = None) -> dict:
    """`geometry`: the family's activation_geometry (tasks/models/bases/adapter.py); `factors`: its activation
    constants (family_factors; None: the denoiser class's, activation_factors).
    `copies`: how many denoisers of this shape training holds (Wan 2.2's two experts under one LoRA): their
    weights count each, the LoRA and the activations once (one expert runs an item); train.blocks_to_swap takes
    the last copy's blocks first (wan22_experts.TwoExperts.blocks)."""
    tc, mc = cfg.train, cfg.model
    folder = Path(model_dir) / denoiser_folder
    config = json.loads((folder / "config.json").read_text())
    shapes = header_shapes(folder)
    params = sum(_numel(s) for s in shapes.values())
    # the skip patterns matter only with an fp8 base (and import diffusers: not for every no-op run)
    stored = stored_as(mc)
    skip = layerwise_skip_patterns(denoiser_cls, mc.storage_modulation) if stored else ()
    per_weight = weight_bytes(shapes, mc.dtype, stored, skip)
    # train.blocks_to_swap: those blocks' Linear/Conv weights wait on the host; one layer at a time is on the
    # device (counted: the largest, in the compute dtype)
    swap = tc.blocks_to_swap
    per_copy = len(block_order(shapes, swap_lists)) if swap_lists else 0
    if copies > 1 and swap > per_copy * copies:
        from tasks.config import ConfigError
        raise ConfigError(f"train.blocks_to_swap={swap}: the {copies} experts have {per_copy * copies} transformer "
                          f"blocks; swap {per_copy * copies} or fewer")
    # each copy's swapped weights, the last copy's first (a name may be swapped in several copies: a list)
    counts = [min(per_copy, max(0, swap - c * per_copy)) for c in range(copies)] if copies > 1 else [swap]
    swapped = [k for n in counts for k in swapped_weights(shapes, swap_lists, n)] if swap_lists else []
    host_bytes = sum(per_weight[k] for k in swapped)
    in_flight = max((_numel(shapes[k]) * DTYPE_BYTES[mc.dtype] for k in swapped), default=0)
    held_bytes = round(copies * sum(per_weight.values()) - host_bytes + in_flight)
    params *= copies
    lora = lora_params(shapes, targets, tc.rank)
    # AdamW: two fp32 moments; 8-bit AdamW two bytes, 8-bit Lion one; Prodigy two moments, s and p0 (fp32);
    # Adafactor a row and a column per matrix (about nothing per parameter; one byte counted)
    optimizer_bytes_per_param = _OPTIMIZER_BYTES.get(tc.optimizer, 8)
    ema_bytes = 4 if tc.ema_decay is not None else 0  # train.ema_decay: an fp32 copy of the LoRA
    lora_bytes = lora * (4 + 4 + optimizer_bytes_per_param + ema_bytes)  # fp32 weights + grads + optimizer states
    tokens, width, blocks = geometry(config, size, text_tokens, cfg.data.frames)
    act_dtype = 2 if tc.mixed_precision in ("bf16", "fp16") else DTYPE_BYTES[mc.dtype]
    items = shard_memory.items_per_rank(tc)  # this process's share of the batch (data parallel, fsdp)
    unit = tokens * width * act_dtype * items
    f = Factors(*(factors or activation_factors(config)))
    if tc.gradient_checkpointing and tc.gradient_checkpointing_offload:
        # each block's input (one token x width value each) waits on the host; one is back for its recompute (what
        # else comes back with it, TI2V-5B's timestep embedding, is in the family's in_flight); the host holds a copy
        # of every block's inputs (Factors)
        activations = (blocks * (f.ckpt_input - 1) + 1 + f.recompute) * unit
        host_bytes += blocks * (f.offloaded * unit + f.text_offloaded * text_tokens * width * act_dtype * items)
    elif tc.gradient_checkpointing:
        activations = (blocks * f.ckpt_input + f.recompute) * unit
    else:
        activations = blocks * f.per_block * unit
    largest = max((_numel(shapes[k]) for k, b in per_weight.items() if stored and k.endswith(".weight")
                   and len(shapes[k]) >= 2 and b < _numel(shapes[k]) * DTYPE_BYTES[mc.dtype]), default=0)
    upcast = f"{stored}+bnb" if stored == "nf4" and w8a8.resolve(mc) == "bnb" else stored
    transient = max(f.in_flight * unit, UPCAST_BYTES.get(upcast, 0.0) * largest - lora * 4)
    total = held_bytes + lora_bytes + activations + transient
    out = {"params": params, "lora_params": lora, "weights_gb": held_bytes / GB, "lora_and_optimizer_gb": lora_bytes / GB,
           "activations_gb": activations / GB, "transient_gb": transient / GB, "total_gb": total / GB,
           "host_gb": host_bytes / GB}  # train.shard=fsdp: one process's (tasks/training/shard_memory.py)
    return shard_memory.per_rank(out, tc, shapes, per_weight, swap_lists, lambda s: lora_params(s, targets, tc.rank)) \
        if shard_memory.sharded(tc) else out


def errors(cfg: Config, adapter_cls) -> list[str]:
    """The memory options' refusals (validate's config_errors): each names its keys and the fix."""
    tc, out = cfg.train, []
    if tc.network == "dora" and cfg.model.expert == "both":  # Wan 2.2 (tasks/models/wan22_experts.py)
        out.append("train.network=dora with model.expert=both: DoRA's magnitude is the base weight's norm, which "
                   "differs per expert; use train.network=lora, or -m model.expert=high,low")
    if tc.gradient_checkpointing_offload and not tc.gradient_checkpointing:
        out.append("train.gradient_checkpointing_offload=true keeps what checkpointing saves on the host: set "
                   "train.gradient_checkpointing=true too (or drop the offload)")
    swap = tc.blocks_to_swap
    if swap < 0 or (swap and not adapter_cls.swap_blocks):
        out.append(f"train.blocks_to_swap={swap}: " + ("a count of blocks, 0 or more" if swap < 0 else
                   f"model.family={cfg.model.family} has no transformer blocks to swap; set it to 0"))
    elif swap and tc.network == "dora":
        out.append("train.network=dora with train.blocks_to_swap: DoRA reads the base weights of the swapped "
                   "blocks directly; use train.network=lora, or train.blocks_to_swap=0")
    stored = stored_as(cfg.model)
    if tc.network == "dora" and stored and stored != "int8":
        # DoRA reads the base weight for its norm directly, past the stored base's autograd cast; peft
        # dequantizes torchao's Int8Tensor there (dequantize_module_weight), not an fp8 or NF4 weight
        key = f"model.quantize={cfg.model.quantize}" if cfg.model.quantize != "none" else \
            f"model.storage_dtype={cfg.model.storage_dtype}"
        out.append(f"train.network=dora with {key}: DoRA reads the base weights for its norm; keep the base in "
                   "the compute dtype or use model.quantize=int8 (or train.network=lora)")
    return out


def available_gb() -> tuple[float, str]:
    """Free memory of the training device (CUDA), else the machine's available RAM."""
    if cuda_available():
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free / GB, f"free memory of {torch.cuda.get_device_name()}"
    return host_available_gb()


def host_available_gb() -> tuple[float, str]:
    """The machine's available RAM (MemAvailable: free plus what the kernel can reclaim)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        m = re.search(r"MemAvailable:\s+(\d+) kB", meminfo.read_text())
        if m:
            return int(m.group(1)) * 1024 / GB, "available RAM"
    return float("inf"), "unknown"


_OPTIMIZER_BYTES = {"adamw8bit": 2, "lion8bit": 1, "prodigy": 16, "adafactor": 1}
# What a user can change, in the order people try them (each alone first).
REMEDIES = (("train.gradient_checkpointing=true", ("train", "gradient_checkpointing"), True),
            ("train.optimizer=adamw8bit", ("train", "optimizer"), "adamw8bit"),
            ("model.quantize=fp8", ("model", "quantize"), "fp8"),
            ("model.quantize=int8", ("model", "quantize"), "int8"),
            ("model.quantize=nf4", ("model", "quantize"), "nf4"),
            ("train.batch_size=1", ("train", "batch_size"), 1))
_QUANTIZE = ("fp8", "int8", "nf4")
# with checkpointing (the combined search only): the saved block inputs on the host (activation_offload.py)
OFFLOAD = ("train.gradient_checkpointing_offload=true", ("train", "gradient_checkpointing_offload"), True)


def _with(cfg: Config, changes: list[tuple]) -> Config:
    # model.quantize takes model.storage_dtype's place: one way to store the base (validate refuses both)
    quantized = any(key == "quantize" for _, (_, key), _ in changes)
    return updated(cfg, {f"{section}.{key}": value for _, (section, key), value in changes}
                   | ({"model.storage_dtype": None} if quantized else {}))


def fitting_settings(cfg: Config, budget_gb: float, estimate_fn, max_swap: int = 0, remedies=REMEDIES) -> list[str]:
    """What would fit the budget: each remedy alone that does; else checkpointing + 8-bit AdamW with the fewest
    blocks swapped (up to `max_swap`) and, at that count, the least quantized base (as is, fp8, int8, nf4)."""
    open_ = [r for r in remedies if getattr(getattr(cfg, r[1][0]), r[1][1]) != r[2] and not (
        r[1][1] == "quantize" and stored_as(cfg.model) in ("int8", "nf4") and r[2] == "fp8")]
    fits = []
    for r in open_:
        gb = estimate_fn(_with(cfg, [r]))["total_gb"]
        if gb <= budget_gb:
            fits.append(f"{r[0]} ({gb:.1f} GiB)")
    if fits:
        return fits
    base = [r for r in open_ if r[1][1] in ("gradient_checkpointing", "optimizer")]
    stores = [[]] + [[r] for r in open_ if r[1][1] == "quantize"]
    offloads = [[]] + ([] if cfg.train.gradient_checkpointing_offload else [[OFFLOAD]])
    for swap in range(0, max_swap + 1):  # the fewest blocks swapped (each costs a copy a step), then the
        for offload in offloads:          # activations kept on the device, then the least quantized base
            for store in stores:
                changes = base + offload + store + (
                    [(f"train.blocks_to_swap={swap}", ("train", "blocks_to_swap"), swap)] if swap else [])
                if not changes:
                    continue
                gb = estimate_fn(_with(cfg, changes))["total_gb"]
                if gb <= budget_gb:
                    return [" ".join(c[0] for c in changes) + f" ({gb:.1f} GiB)"]
    return []


def preflight(cfg: Config, adapter, size: tuple[int, int]) -> dict:
    """The estimate for this run; raises ConfigError when it exceeds the budget, naming what would fit."""
    from tasks.config import ConfigError

    targets = lora_targets(cfg.train, adapter)

    def estimate_for(c):
        return estimate(c, adapter.model_dir, adapter.denoiser_subfolder, targets, size,
                        c.model.max_sequence_length, adapter.denoiser_cls if stored_as(c.model) else None,
                        adapter.swap_blocks, adapter.denoisers, geometry=adapter.activation_geometry,
                        factors=family_factors(adapter))

    est = estimate_for(cfg)
    limit = cfg.train.memory_limit_gb
    budget, source = (limit, "train.memory_limit_gb") if limit else available_gb()
    est.update(budget_gb=None if budget == float("inf") else budget, budget_source=source)
    if est["total_gb"] > budget:
        blocks = 0 if shard_memory.sharded(cfg.train) else adapter.denoisers * len(block_order(header_shapes(
            Path(adapter.model_dir) / adapter.denoiser_subfolder), adapter.swap_blocks))  # fsdp: no swap
        fits = fitting_settings(cfg, budget, estimate_for, blocks, shard_memory.remedies(cfg, REMEDIES))
        hint = ("would fit: " + "; ".join(fits)) if fits else shard_memory.nothing_fits(cfg) or (
            "nothing in train.gradient_checkpointing (+_offload), train.optimizer=adamw8bit, model.quantize=fp8|int8|nf4, "
            f"train.blocks_to_swap (up to {blocks}) or train.batch_size=1 fits: use a smaller data.resolution or a "
            "bigger device")
        hint += shard_memory.hint(cfg, adapter, budget, estimate_for)  # beside them: a shard count that fits
        raise ConfigError(
            f"training will not fit in memory: about {est['total_gb']:.1f} GiB needed (weights {est['weights_gb']:.1f}, "
            f"LoRA + optimizer {est['lora_and_optimizer_gb']:.2f}, activations {est['activations_gb']:.1f} at "
            f"{size[0]}x{size[1]}, batch {cfg.train.batch_size}) > {budget:.1f} GiB ({source}); {hint}")
    return est
