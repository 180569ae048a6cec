"""Node validate: check the config, the model, the dataset and the sample prompts before any work.

Everything that is wrong is collected and reported at once (file or key, reason, fix); nothing
downstream runs. Its output, the *plan*, is small JSON: digests and names, never tensors."""
from __future__ import annotations

import logging
from pathlib import Path

from tasks.config import ConfigError
from tasks.dataset import validate_dataset
from tasks.hashing import digest_file, key_of
from tasks.models import adapter_class, component_ids, resolve_model
from tasks.prompts import read_prompts
from tasks.sizes import resolve_size
from tasks.store import Store

CODE_VERSION = "1"
log = logging.getLogger("loraflow")

_CHOICES = {("data", "resolution_type"): ("pixels", "area"), ("train", "lr_scheduler"):
            ("constant", "constant_with_warmup", "linear", "cosine"), ("train", "weighting_scheme"):
            ("none", "logit_normal", "mode", "sigma_sqrt", "cosmap"), ("model", "dtype"): ("float32", "bfloat16", "float16"),
            ("export", "format"): ("kohya", "diffusers", "both")}
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
    if cfg["data"]["missing_caption"] not in ("error", "empty"):
        errors.append(f"data.missing_caption={cfg['data']['missing_caption']!r}: choose error or empty")
    return errors


def run(cfg: dict, store: Store) -> dict:
    errors = check_config(cfg)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    family = cfg["model"]["family"]
    adapter_cls = adapter_class(family)
    size = resolve_size(cfg["data"]["resolution"], cfg["data"]["resolution_type"], adapter_cls.size_multiple)

    items = validate_dataset(cfg["data"]["dir"], cfg["data"]["missing_caption"], cfg["data"]["caption_extension"])
    prompts, warnings = read_prompts(cfg["sample"]["prompts_file"])
    for w in warnings:
        log.warning("sample prompts: %s", w)
    plan_prompts, multiple = [], adapter_cls.size_multiple
    for p in prompts:
        width, height = p.width, p.height
        for name, value in (("--w", width), ("--h", height)):
            if value and value % adapter_cls.size_multiple:
                warnings.append(f"{cfg['sample']['prompts_file']}:{p.line}: {name} {value} is not a multiple of "
                                f"{adapter_cls.size_multiple}; rounded down")
        width = width and max(multiple, width // multiple * multiple)
        height = height and max(multiple, height // multiple * multiple)
        plan_prompts.append({"line": p.line, "prompt": p.prompt, "negative": p.negative, "width": width,
                             "height": height, "steps": p.steps, "guidance": p.guidance, "true_cfg": p.true_cfg,
                             "seed": p.seed})

    model_dir = resolve_model(cfg["model"], store)
    ids = {group: key_of(component_ids(model_dir, names, store)) for group, names in (
        ("vae", adapter_cls.latent_components), ("text", adapter_cls.text_components),
        ("denoiser", adapter_cls.denoiser_components), ("sample", adapter_cls.sample_components))}
    plan_items = [{"name": it.name, "image": str(it.image_path), "image_digest": digest_file(it.image_path),
                   "caption": it.caption} for it in items]
    log.info("validate: %d images, %d sample prompts, model %s (%s), size %dx%d",
             len(plan_items), len(plan_prompts), model_dir, family, *size)
    return {"family": family, "model_dir": str(model_dir), "ids": ids, "size": list(size), "items": plan_items,
            "prompts": plan_prompts, "warnings": warnings}


def inputs(plan: dict) -> dict:
    return {"node": "validate", "code": CODE_VERSION, "model": plan["ids"], "size": plan["size"],
            **{f"image:{it['name']}": it["image_digest"] for it in plan["items"]}}
