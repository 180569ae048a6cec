"""Preflight memory estimate for the train node: weights, LoRA + optimizer states and activations at the
chosen size and batch, against the memory the device has free. Read from the denoiser's config and
safetensors headers (no weights loaded). When it will not fit, the message names the settings that
would make it fit.

The activation term is linear in tokens x width per block, with constants measured by `python -m bench.memory`
on FLUX.1-dev (bf16 autocast, rank 16, 1024 and 512 px + 512 text tokens; bench/memory.json): what autograd
saves, counted from real tensor shapes. For SD3 and the UNets the same constants are a rule of thumb, not
measured. Transient buffers, the CUDA context and fragmentation are not in it: `bench/gpu.py` measures a GPU's
real peak."""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from tasks.runtime import cuda_available

GB = 1024 ** 3
# Saved values per token x width, measured (bench/memory.json; 1024 px / 512 px):
ACT_FACTOR = 22.6  # per block, no checkpointing: Flux's double/single mean, outside layers included (22.5/22.7)
CKPT_INPUT_FACTOR = 1.03  # per block with checkpointing: its checkpointed inputs, outside layers included (1.034/1.030)
RECOMPUTE_FACTOR = 22.5  # one block's internals while its recompute is held in backward (22.4/22.6)
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _weights(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors headers of a model folder."""
    shapes = {}
    for file in sorted(folder.glob("*.safetensors")):
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


def lora_targets(tc: dict, adapter) -> list[str] | str:
    """train.target_modules (suffixes) or the family's default (suffixes or one full-path regex)."""
    return list(tc["target_modules"]) if tc["target_modules"] else adapter.default_lora_targets()


def _lora_params(shapes: dict[str, list[int]], targets: list[str] | str, rank: int) -> int:
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
    if not storage_dtype:
        return sum(_numel(s) for s in shapes.values()) * _BYTES[dtype]

    def stored_low(name: str, shape) -> bool:
        if not name.endswith(".weight") or len(shape) < 2:
            return False
        parts = name.split(".")[:-1]
        return not any(re.search(p, ".".join(parts[:i])) for i in range(1, len(parts) + 1) for p in skip_patterns)

    return sum(_numel(s) * _BYTES[storage_dtype if stored_low(n, s) else dtype] for n, s in shapes.items())


def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int) -> tuple[int, int, int]:
    """(tokens, width, blocks) of the denoiser at this training size, from its config."""
    w, h = size
    if "num_single_layers" in config or "joint_attention_dim" in config:  # Flux / SD3 / Qwen-Image transformers
        width = config["num_attention_heads"] * config["attention_head_dim"]
        patch = config.get("patch_size", 1) * (2 if "num_single_layers" in config else 1)
        tokens = (h // (8 * patch)) * (w // (8 * patch)) + text_tokens
        blocks = config.get("num_layers", 0) + config.get("num_single_layers", 0)
        return tokens, width, blocks
    if "n_refiner_layers" in config:  # Z-Image's single-stream DiT: image and caption tokens in one sequence
        patch = config["all_patch_size"][0]
        tokens = (h // (8 * patch)) * (w // (8 * patch)) + text_tokens
        # the refiners run on the image (noise_refiner) or the caption (context_refiner) tokens alone: counted
        # as one full block per refiner layer (an overestimate of the caption side's share)
        return tokens, config["dim"], config["n_layers"] + config["n_refiner_layers"]
    # UNet: the first level dominates (most tokens); count every resnet/attention block at its width.
    channels = config["block_out_channels"]
    tokens = (h // 8) * (w // 8)
    blocks = len(channels) * config.get("layers_per_block", 2) * 2
    return tokens, channels[0], blocks


def estimate(cfg: dict, model_dir: Path, denoiser_folder: str, targets: list[str], size: tuple[int, int],
             text_tokens: int, denoiser_cls=None) -> dict:
    tc, mc = cfg["train"], cfg["model"]
    folder = Path(model_dir) / denoiser_folder
    config = json.loads((folder / "config.json").read_text())
    shapes = _weights(folder)
    params = sum(_numel(s) for s in shapes.values())
    # the skip patterns matter only with an fp8 base (and import diffusers: not for every no-op run)
    skip = layerwise_skip_patterns(denoiser_cls, mc.get("storage_modulation", False)) if mc["storage_dtype"] else ()
    weight_bytes = stored_weight_bytes(shapes, mc["dtype"], mc["storage_dtype"], skip)
    lora = _lora_params(shapes, targets, tc["rank"])
    # AdamW: two fp32 moments; 8-bit AdamW two bytes, 8-bit Lion one; Prodigy two moments, s and p0 (fp32);
    # Adafactor a row and a column per matrix (about nothing per parameter; one byte counted)
    optimizer_bytes_per_param = _OPTIMIZER_BYTES.get(tc["optimizer"], 8)
    ema_bytes = 4 if tc.get("ema_decay") is not None else 0  # train.ema_decay: an fp32 copy of the LoRA
    lora_bytes = lora * (4 + 4 + optimizer_bytes_per_param + ema_bytes)  # fp32 weights + grads + optimizer states
    tokens, width, blocks = activation_geometry(config, size, text_tokens)
    act_dtype = 2 if tc["mixed_precision"] in ("bf16", "fp16") else _BYTES[mc["dtype"]]
    unit = tokens * width * act_dtype * tc["batch_size"]
    if tc["gradient_checkpointing"]:
        activations = (blocks * CKPT_INPUT_FACTOR + RECOMPUTE_FACTOR) * unit
    else:
        activations = blocks * ACT_FACTOR * unit
    total = weight_bytes + lora_bytes + activations
    return {"params": params, "lora_params": lora, "weights_gb": weight_bytes / GB, "lora_and_optimizer_gb": lora_bytes / GB,
            "activations_gb": activations / GB, "total_gb": total / GB}


def available_gb() -> tuple[float, str]:
    """Free memory of the training device (CUDA), else the machine's available RAM."""
    if cuda_available():
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free / GB, f"free memory of {torch.cuda.get_device_name()}"
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        m = re.search(r"MemAvailable:\s+(\d+) kB", meminfo.read_text())
        if m:
            return int(m.group(1)) * 1024 / GB, "available RAM"
    return float("inf"), "unknown"


_OPTIMIZER_BYTES = {"adamw8bit": 2, "lion8bit": 1, "prodigy": 16, "adafactor": 1}
# What a user can change, in the order people try them.
REMEDIES = (("train.gradient_checkpointing=true", ("train", "gradient_checkpointing"), True),
            ("train.optimizer=adamw8bit", ("train", "optimizer"), "adamw8bit"),
            ("model.storage_dtype=float8_e4m3fn", ("model", "storage_dtype"), "float8_e4m3fn"),
            ("model.storage_modulation=true", ("model", "storage_modulation"), True),
            ("train.batch_size=1", ("train", "batch_size"), 1))


def fitting_settings(cfg: dict, budget_gb: float, estimate_fn) -> list[str]:
    """The remedies (alone, then all applicable together) whose estimate fits the budget."""
    def with_changes(changes):
        new = {**cfg, "train": dict(cfg["train"]), "model": dict(cfg["model"])}
        for _, (section, key), value in changes:
            new[section][key] = value
        return new

    open_ = [r for r in REMEDIES if cfg[r[1][0]].get(r[1][1]) != r[2]]
    fits = []
    for r in open_:
        gb = estimate_fn(with_changes([r]))["total_gb"]
        if gb <= budget_gb:
            fits.append(f"{r[0]} ({gb:.1f} GiB)")
    if not fits and open_:
        together = estimate_fn(with_changes(open_))["total_gb"]
        if together <= budget_gb:
            fits.append(" + ".join(r[0] for r in open_) + f" together ({together:.1f} GiB)")
    return fits


def preflight(cfg: dict, adapter, size: tuple[int, int]) -> dict:
    """The estimate for this run; raises ConfigError when it exceeds the budget, naming what would fit."""
    from tasks.config import ConfigError

    targets = lora_targets(cfg["train"], adapter)

    def estimate_for(c):
        return estimate(c, adapter.model_dir, adapter.denoiser_subfolder, targets, size,
                        c["model"]["max_sequence_length"], adapter.denoiser_cls if c["model"]["storage_dtype"] else None)

    est = estimate_for(cfg)
    limit = cfg["train"]["memory_limit_gb"]
    budget, source = (limit, "train.memory_limit_gb") if limit else available_gb()
    est.update(budget_gb=None if budget == float("inf") else budget, budget_source=source)
    if est["total_gb"] > budget:
        fits = fitting_settings(cfg, budget, estimate_for)
        hint = ("would fit: " + "; ".join(fits)) if fits else ("nothing in train.gradient_checkpointing, "
                                                               "train.optimizer=adamw8bit, model.storage_dtype=float8_e4m3fn (with "
                                                               "model.storage_modulation=true) or "
                                                               "train.batch_size=1 fits: use a smaller data.resolution or a "
                                                               "bigger device")
        raise ConfigError(
            f"training will not fit in memory: about {est['total_gb']:.1f} GiB needed (weights {est['weights_gb']:.1f}, "
            f"LoRA + optimizer {est['lora_and_optimizer_gb']:.2f}, activations {est['activations_gb']:.1f} at "
            f"{size[0]}x{size[1]}, batch {cfg['train']['batch_size']}) > {budget:.1f} GiB ({source}); {hint}")
    return est
