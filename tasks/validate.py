"""Node validate: check the config, the model, the dataset and the sample prompts before any work.

Everything that is wrong is collected and reported at once (file or key, reason, fix); nothing
downstream runs. Its output, the *plan*, is small JSON: digests and names, never tensors."""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter

from tasks.captioning import limits
from tasks.config import Config, ConfigError
from tasks.config_schema import DataConfig
from tasks.data import augment, controls, first_frame, masks, subsets, video
from tasks.data.dataset import SHARED_CAPTION, SKIPPED
from tasks.data.image_memo import ImageMemo
from tasks.data.prompts import read_prompts
from tasks.data.sizes import bucket_sizes, nearest_bucket, resolve_size
from tasks.models import adapter_class, component_ids, make_adapter, resolve_model
from tasks.models.lora_variants import text_encoder_lora as te_lora
from tasks.plan import Plan
from tasks.runtime import cuda_available
from tasks.store import Store
from tasks.store.hashing import digest_file, key_of
from tasks import run_memory
from tasks.training import host_memory, memory, validation_loss as validation
# the config checks (re-exported: the CLI and the tests call validate.config_errors)
from tasks.config_checks import check_config, check_sizes, config_errors  # noqa: F401


CODE_VERSION = "1"
FLIPPED = ":flipped"  # suffix of a flipped twin's name (data.flip_aug); no image file name ends with it
log = logging.getLogger("loraflow")


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
                        "steps": p.steps, "guidance": p.guidance, "true_cfg": p.true_cfg, "seed": p.seed,
                        **({"frames": p.frames} if p.frames else {}),
                        **controls.prompt_images(p, prompts_file)})
    return planned, warnings


def run(cfg: Config, store: Store, captions: dict[str, str] | None = None) -> dict:
    """The plan every later node reads: the dataset's items, the prompts, the model's identity, the memory
    estimate. Refuses a bad config, dataset or model here, before anything is cached. `captions`: the caption
    node's, by image file (read instead of those images' caption files)."""
    errors = config_errors(cfg)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    store.sweep_debris()  # what an earlier run left in tmp/ when it was killed
    family = cfg.model.family
    adapter_cls = adapter_class(family)
    size = resolve_size(cfg.data.resolution, cfg.data.resolution_type, adapter_cls.size_multiple)
    items, dataset, dataset_subsets, layout_warnings = _read_dataset(cfg.data, store, adapter_cls, captions)
    plan_prompts, warnings = _read_prompts(cfg, adapter_cls, layout_warnings + _dataset_warnings(dataset))
    augmentation = _augmentation(cfg)
    model_dir, ids = _model_identity(cfg, store, adapter_cls)
    adapter = make_adapter(cfg.model, model_dir)
    estimate = memory.preflight(cfg, adapter, size)
    estimate.update(host_memory.preflight(cfg, adapter, size, estimate))  # RAM: swap, offload, loading (issue 43)
    # every other node against the same budget (and the RAM, with a GPU), before any node runs (issue 61)
    run = run_memory.check(cfg, adapter, size, plan_prompts, estimate,
                           memory.host_available_gb() if cuda_available() else None)
    estimate.update(nodes=run["nodes"], run_peak_gb=run["peak_gb"], run_host_gb=run["host_gb"])
    budget = estimate["budget_gb"]  # rounded like the estimate (was printed with every float digit)
    log.info("validate: memory estimate %.2f GiB, budget %s GiB (%s)", estimate["total_gb"],
             f"{budget:.2f}" if isinstance(budget, (int, float)) else budget, estimate["budget_source"])
    log.info("validate: the whole run's peak %.2f GiB (%s), host RAM %.2f GiB", run["peak_gb"],
             ", ".join(f"{n} {e['device_gb']:.2f}" for n, e in run["nodes"].items()), run["host_gb"])
    plan_items, items, dataset = _plan_items(cfg, items, dataset, adapter_cls, size)
    if captions:  # the caption node's captions that the text window cuts
        made = {it["name"]: it["caption"] for it in plan_items if "flip_of" not in it and it["image"] in captions}
        for w in limits.over_limit(model_dir, adapter_cls.text_components, cfg.model.max_sequence_length, made):
            log.warning("data: %s", w)
            warnings.append(f"data: {w}")
    if errs := controls.prompt_errors(plan_prompts, cfg, size, adapter_cls):
        raise ConfigError("\n".join(errs))
    log.info("validate: %d images, %d sample prompts, model %s (%s), size %dx%d",
             len(items), len(plan_prompts), model_dir, family, *size)
    dc = cfg.data
    held = validation.held_out(plan_items, dc.validation_split)  # cached like the others, never trained
    if held:
        log.info("validate: %d item(s) held out for the validation loss (data.validation_split=%g): %s",
                 len(held), dc.validation_split, ", ".join(held[:5]) + (", ..." if len(held) > 5 else ""))
    return Plan(family=family, model_dir=str(model_dir), ids=ids, size=list(size), items=plan_items,
                prompts=plan_prompts, warnings=warnings, augmentation=augmentation, memory=estimate, dataset=dataset,
                dataset_subsets=dataset_subsets, validation_items=held,
                video=video.sample_defaults(dc, adapter_cls.clips.default_fps) if adapter_cls.clips else None)


def _read_dataset(dc: DataConfig, store: Store, adapter_cls, captions: dict[str, str] | None = None
                  ) -> tuple[list, list[dict], list[dict], list[str]]:
    """(item, its name, its subset) of every subset in subset order, the findings on bad files, the subsets'
    report and the folder layout's warnings."""
    chosen, layout_warnings = subsets.resolve(dc)
    memos = {}  # per folder: images decoded and digested before, by stat (tasks/data/image_memo.py)
    checked = subsets.check(dc, chosen, lambda folder: memos.setdefault(
        folder, ImageMemo(store.root, folder, use_stored=not store.rehash)), clips=adapter_cls.clips is not None,
        generated=captions)
    for memo in memos.values():
        memo.save(lambda path, data: store.write_small(path, data, f"the image memo {path.name}"))
    items = [(it, s.name(it.name), s) for s, check in checked for it in check.items]
    findings = sorted((f for _, check in checked for f in check.findings), key=lambda f: (f.file, f.reason))
    if first_frame.enabled(adapter_cls):
        findings = first_frame.without_pair_notes(findings, items)
    dataset = [dataclasses.asdict(f) for f in findings]
    return items, dataset, [s.report(len(check.items)) for s, check in checked], layout_warnings


def _read_prompts(cfg: Config, adapter_cls, warnings: list[str]) -> tuple[list[dict], list[str]]:
    prompts, prompt_warnings = read_prompts(cfg.sample.prompts_file)
    warnings = warnings + prompt_warnings
    plan_prompts, size_warnings = planned_prompts(prompts, cfg.sample.prompts_file, adapter_cls.size_multiple)
    warnings += size_warnings
    for w in warnings:
        log.warning("sample prompts: %s", w)
    return plan_prompts, warnings


def _augmentation(cfg: Config) -> dict:
    aug = augment.from_config(cfg.data, cfg.text, cfg.train.max_steps)
    mode = augment.text_mode(te_lora.text_settings(cfg), aug)  # train.text_encoder_lr: live
    augmentation = {"mode": mode, "active": augment.active(aug), "description": augment.describe(aug, mode)}
    if augmentation["active"]:
        log.info(augmentation["description"])
    return augmentation

def _model_identity(cfg: Config, store: Store, adapter_cls) -> tuple:
    """The model's folder and the identity of each group of components the nodes' keys name."""
    model_dir = resolve_model(cfg.model, store)
    ids = {group: key_of(component_ids(model_dir, names, store)) for group, names in (
        ("vae", adapter_cls.latent_components), ("text", adapter_cls.text_components),
        ("denoiser", adapter_cls.denoiser_components), ("sample", adapter_cls.sample_components),
        ("scheduler", ("scheduler",)))}  # the training noise schedule the loop loads (shift, prediction_type)
    options = pipeline_options(model_dir)
    if options:  # e.g. SDXL's force_zeros_for_empty_prompt: sampling reads them; no key changes without them
        ids["sample"] = key_of({"components": ids["sample"], "model_index": options})
    return model_dir, ids


def _plan_items(cfg: Config, items: list, dataset: list[dict], adapter_cls, size) -> tuple:
    """The plan's items: each with its digest and caption, its clip's frames, mask and control images, its bucket,
    and the mirror images (data.flip_aug); the items left and the findings grown by what was left out."""
    dc = cfg.data
    # repeats / is_reg only where not at their defaults: a plain folder's plan (and keys) stay as they were
    plan_items = [{"name": name, "image": it.image_file, "image_digest": it.digest or digest_file(it.image_file),
                   "caption": it.caption, **({"repeats": s.repeats} if s.repeats != 1 else {}),
                   **({"is_reg": True} if s.is_reg else {})} for it, name, s in items]
    video.attach(dc, plan_items, [it for it, _, _ in items], adapter_cls.clips)  # each clip's frames and rate
    if first_frame.enabled(adapter_cls):  # image-to-video: each clip's condition image, as its control
        plan_items, left_out, errs = first_frame.attach(dc, plan_items, items)
        if errs:
            raise ConfigError(f"image-to-video: {len(errs)} clip(s) cannot train:\n  " + "\n  ".join(errs))
        kept = {e["name"] for e in plan_items}
        items = [t for t in items if t[1] in kept]
        dataset = sorted(dataset + left_out, key=lambda f: (f["file"], f["reason"]))
    for attach in ([masks.attach] if masks.enabled(dc) else []) + ([controls.attach] if dc.control_dirs else []):
        plan_items, left_out = attach(dc, plan_items, items)  # each item's mask / control images
        kept = {e["name"] for e in plan_items}
        items = [t for t in items if t[1] in kept]
        dataset = sorted(dataset + left_out, key=lambda f: (f["file"], f["reason"]))
    if cfg.data.buckets:  # each image trains at the bucket closest to its aspect, about the same area
        buckets = bucket_sizes(*size, adapter_cls.size_multiple, cfg.data.bucket_max_aspect)
        for entry, (it, _, _) in zip(plan_items, items):
            entry["size"] = list(nearest_bucket(*it.size, buckets))
        counts = {}
        for entry in plan_items:
            counts[tuple(entry["size"])] = counts.get(tuple(entry["size"]), 0) + 1
        log.info("validate: %d bucket(s): %s", len(counts),
                 ", ".join(f"{w}x{h}: {n}" for (w, h), n in sorted(counts.items())))
    if dc.flip_aug:  # the mirror image: one more item, its own latent, its source's caption texts
        plan_items += [{**entry, "name": entry["name"] + FLIPPED, "flip_of": entry["name"]} for entry in plan_items]
    return plan_items, items, dataset


def pipeline_options(model_dir) -> dict:
    """model_index.json's pipeline options (not components, not _class_name/_diffusers_version)."""
    import json
    from pathlib import Path

    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    return {k: v for k, v in index.items() if not k.startswith("_") and not (isinstance(v, list) and len(v) == 2)}


def _dataset_warnings(dataset: list[dict]) -> list[str]:
    """Log each file left out and one summary line; warn (report) about what changes the training set."""
    for f in dataset:
        if f["policy"] == SKIPPED:
            log.warning("data: %s: %s (skipped, data.bad_files=skip)", f["file"], f["reason"])
    if dataset:
        counts = Counter(f["policy"] for f in dataset)
        log.info("validate: dataset notes for %d file(s) (report.json 'dataset'): %s", len({f["file"] for f in dataset}),
                 "; ".join(f"{policy}: {n}" for policy, n in sorted(counts.items())))
    warnings = []
    skipped = sorted({f["file"] for f in dataset if f["policy"] == SKIPPED})
    if skipped:
        warnings.append(f"data: {len(skipped)} file(s) left out by data.bad_files=skip: {', '.join(skipped)}")
    shared = [f["file"] for f in dataset if f["policy"] == SHARED_CAPTION]
    if shared:
        warnings.append(f"data: images with the same stem share one caption file, each trained with it: "
                        f"{', '.join(shared)}")
    return warnings


def images(plan: Plan) -> int:
    """The items validate checked: a flipped twin (data.flip_aug) is its source image again."""
    return sum("flip_of" not in it for it in plan.items)


def inputs(plan: Plan) -> dict:
    return {"node": "validate", "code": CODE_VERSION, "model": plan.ids, "size": plan.size,
            **{f"image:{it['name']}": it["image_digest"] for it in plan.items}}
