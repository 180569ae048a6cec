"""Node validate: check the config, the model, the dataset and the sample prompts before any work.

Everything that is wrong is collected and reported at once (file or key, reason, fix); nothing
downstream runs. Its output, the *plan*, is small JSON: digests and names, never tensors."""
from __future__ import annotations

import logging
from pathlib import Path

from tasks import augment, memory
from tasks.config import ConfigError
from tasks.dataset import validate_dataset
from tasks.hashing import digest_file, key_of
from tasks.models import adapter_class, component_ids, resolve_model
from tasks.prompts import read_prompts
from tasks.sizes import bucket_sizes, nearest_bucket, resolve_size
from tasks.store import Store

CODE_VERSION = "1"
log = logging.getLogger("loraflow")

_CHOICES = {("data", "resolution_type"): ("pixels", "area"), ("train", "lr_scheduler"):
            ("constant", "constant_with_warmup", "linear", "cosine"), ("train", "weighting_scheme"):
            ("none", "logit_normal", "mode", "sigma_sqrt", "cosmap"), ("model", "dtype"): ("float32", "bfloat16", "float16"),
            ("export", "format"): ("kohya", "diffusers", "both"), ("sample", "generator_device"): ("cpu", "device"),
            ("train", "resume"): ("auto", "never"), ("train", "optimizer"): ("adamw", "adamw8bit"),
            ("train", "mixed_precision"): ("no", "bf16", "fp16")}
_POSITIVE = (("train", "max_steps"), ("train", "lr"), ("train", "rank"), ("train", "batch_size"),
             ("train", "log_every"), ("sample", "steps"), ("data", "resolution"), ("model", "max_sequence_length"))


def check_config(cfg: dict) -> list[str]:
    errors = []
    for (section, key), allowed in _CHOICES.items():
        if cfg[section][key] not in allowed:
            errors.append(f"{section}.{key}={cfg[section][key]!r}: choose one of {', '.join(allowed)}")
    for section, key in _POSITIVE:
        if not cfg[section][key] > 0:
            errors.append(f"{section}.{key}={cfg[section][key]!r}: must be greater than 0")
    errors += _check_device(cfg)
    if not cfg["data"]["bucket_max_aspect"] >= 1:
        errors.append(f"data.bucket_max_aspect={cfg['data']['bucket_max_aspect']!r}: must be at least 1 (e.g. 2.0)")
    for section, key in (("sample", "every_n_steps"), ("train", "save_every_n_steps")):
        if cfg[section][key] < 0:
            errors.append(f"{section}.{key}={cfg[section][key]!r}: must be 0 (off) or a number of steps")
    if cfg["data"]["missing_caption"] not in ("error", "empty"):
        errors.append(f"data.missing_caption={cfg['data']['missing_caption']!r}: choose error or empty")
    return errors


def _check_device(cfg: dict) -> list[str]:
    """Settings this machine cannot run, each with the alternative."""
    import torch

    errors, cuda = [], torch.cuda.is_available()
    if cfg["train"]["mixed_precision"] == "fp16" and not cuda:
        errors.append("train.mixed_precision=fp16 needs a CUDA GPU; on the CPU use train.mixed_precision=bf16 or no")
    if cfg["train"]["optimizer"] == "adamw8bit":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            errors.append("train.optimizer=adamw8bit needs bitsandbytes (pip install bitsandbytes) and a CUDA GPU; "
                          "use train.optimizer=adamw")
        else:
            if not cuda:
                errors.append("train.optimizer=adamw8bit needs a CUDA GPU; on the CPU use train.optimizer=adamw")
    storage = cfg["model"].get("storage_dtype")
    if storage not in (None, "float8_e4m3fn", "float8_e5m2"):
        errors.append(f"model.storage_dtype={storage!r}: choose float8_e4m3fn, float8_e5m2 or null")
    return errors


def check_sizes(cfg: dict, multiple: int) -> list[str]:
    errors = []
    for key in ("width", "height"):
        value = cfg["sample"][key]
        if value is not None and (value <= 0 or value % multiple):
            lo, hi = max(multiple, value // multiple * multiple), (max(value, 0) // multiple + 1) * multiple
            errors.append(f"sample.{key}={value}: must be a multiple of {multiple} for model.family="
                          f"{cfg['model']['family']}; use sample.{key}={lo} or {hi}")
    return errors


def planned_prompts(prompts, prompts_file: str, multiple: int) -> tuple[list[dict], list[str]]:
    """Parsed prompt lines as plan entries (JSON), --w/--h rounded down to the family's multiple."""
    planned, warnings = [], []
    for p in prompts:
        for name, value in (("--w", p.width), ("--h", p.height)):
            if value and value % multiple:
                warnings.append(f"{prompts_file}:{p.line}: {name} {value} is not a multiple of {multiple}; rounded down")
        width = p.width and max(multiple, p.width // multiple * multiple)
        height = p.height and max(multiple, p.height // multiple * multiple)
        planned.append({"line": p.line, "prompt": p.prompt, "negative": p.negative, "width": width, "height": height,
                        "steps": p.steps, "guidance": p.guidance, "true_cfg": p.true_cfg, "seed": p.seed})
    return planned, warnings


def run(cfg: dict, store: Store) -> dict:
    errors = check_config(cfg)
    family = cfg["model"]["family"]
    adapter_cls = adapter_class(family)
    errors += check_sizes(cfg, adapter_cls.size_multiple) + augment.errors(cfg["data"], cfg["text"])
    tc = cfg["text"]
    if tc["offload_encoders"] and (tc["fresh_draws"] or not tc["cache"]):
        why = "text.fresh_draws=true" if tc["fresh_draws"] else "text.cache=false"
        errors.append(f"text.offload_encoders=true with {why}: {why.split('=')[0]} encodes captions in the train node, "
                      f"which needs the text encoders loaded; drop one of the two (with text.cache=true and "
                      f"text.fresh_draws=false, augmentations use cached variants: text.variants=N)")
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    size = resolve_size(cfg["data"]["resolution"], cfg["data"]["resolution_type"], adapter_cls.size_multiple)

    items = validate_dataset(cfg["data"]["dir"], cfg["data"]["missing_caption"], cfg["data"]["caption_extension"])
    prompts, warnings = read_prompts(cfg["sample"]["prompts_file"])
    plan_prompts, size_warnings = planned_prompts(prompts, cfg["sample"]["prompts_file"], adapter_cls.size_multiple)
    warnings += size_warnings
    for w in warnings:
        log.warning("sample prompts: %s", w)

    aug = augment.from_config(cfg["data"], cfg["text"], cfg["train"]["max_steps"])
    mode = augment.text_mode(cfg["text"], aug)
    augmentation = {"mode": mode, "active": augment.active(aug), "description": augment.describe(aug, mode)}
    if augmentation["active"]:
        log.info(augmentation["description"])

    model_dir = resolve_model(cfg["model"], store)
    ids = {group: key_of(component_ids(model_dir, names, store)) for group, names in (
        ("vae", adapter_cls.latent_components), ("text", adapter_cls.text_components),
        ("denoiser", adapter_cls.denoiser_components), ("sample", adapter_cls.sample_components))}
    adapter = adapter_cls(model_dir, cfg["model"]["dtype"], cfg["model"]["max_sequence_length"])
    estimate = memory.preflight(cfg, adapter, size)
    log.info("validate: memory estimate %.2f GB, budget %s GB (%s)", estimate["total_gb"], estimate["budget_gb"],
             estimate["budget_source"])
    plan_items = [{"name": it.name, "image": str(it.image_path), "image_digest": digest_file(it.image_path),
                   "caption": it.caption} for it in items]
    if cfg["data"]["buckets"]:  # each image trains at the bucket closest to its aspect, about the same area
        buckets = bucket_sizes(*size, adapter_cls.size_multiple, cfg["data"]["bucket_max_aspect"])
        for entry, it in zip(plan_items, items):
            entry["size"] = list(nearest_bucket(*it.size, buckets))
        counts = {}
        for entry in plan_items:
            counts[tuple(entry["size"])] = counts.get(tuple(entry["size"]), 0) + 1
        log.info("validate: %d bucket(s): %s", len(counts),
                 ", ".join(f"{w}x{h}: {n}" for (w, h), n in sorted(counts.items())))
    log.info("validate: %d images, %d sample prompts, model %s (%s), size %dx%d",
             len(plan_items), len(plan_prompts), model_dir, family, *size)
    return {"family": family, "model_dir": str(model_dir), "ids": ids, "size": list(size), "items": plan_items,
            "prompts": plan_prompts, "warnings": warnings, "augmentation": augmentation, "memory": estimate}


def inputs(plan: dict) -> dict:
    return {"node": "validate", "code": CODE_VERSION, "model": plan["ids"], "size": plan["size"],
            **{f"image:{it['name']}": it["image_digest"] for it in plan["items"]}}
