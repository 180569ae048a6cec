"""The run's outputs, copied out of the store into its run directory, in the requested LoRA formats.

Both exported files are derived from the stored diffusers LoRA (what training and sampling use) and are
themselves store entries, keyed by the LoRA's key, the format and the converter's version, so each is
converted once: the kohya file, the diffusers file with alpha/rank baked into lora_B (export.bake_alpha), and
for Z-Image the file in ComfyUI's own layout (export_comfyui.to_comfyui; for the other families the kohya file is it).
With train.ema_decay, the EMA LoRA goes beside them as pytorch_lora_weights_ema.safetensors (diffusers).
LoHa/LoKr (train.network): one file, the LyCORIS layout (export_lycoris.to_lycoris), whatever export.format."""
from __future__ import annotations

import shutil
from pathlib import Path

from tasks import charts
from tasks.config import Config
from tasks.lazy import lazy
from tasks.models.lora_variants import lycoris
from tasks.plan import Plan
from tasks.sample import grid_labels, make_grid, slug
from tasks.store import Store
from tasks.store.hashing import key_of
from tasks.training import export, export_comfyui, export_lycoris
from tasks.training.checkpoint_samples import publish_step


st = lazy("safetensors.torch")

KOHYA_KIND = "lora_kohya"
DIFFUSERS_KIND = "lora_diffusers"
LYCORIS_KIND = "lora_lycoris"
CHART_KIND = "loss_chart"  # loss.png of a stored LoRA (tasks/charts.py)


def peft_from_diffusers(state_dict: dict) -> dict:
    """diffusers' file names keys '<component>.<module>...'; peft's state dict has no component prefix."""
    return {k.split(".", 1)[1]: v for k, v in state_dict.items()}


def split_text_encoders(state_dict: dict) -> tuple[dict, dict[str, dict]]:
    """A diffusers file's tensors -> (the denoiser's peft state dict, {text_encoder[_2]: its peft state dict})."""
    text = {}
    for k, v in state_dict.items():
        component, rest = k.split(".", 1)
        if component.startswith("text_encoder"):  # train.text_encoder_lr
            text.setdefault(component, {})[rest] = v
    return peft_from_diffusers({k: v for k, v in state_dict.items() if not k.startswith("text_encoder")}), text


def kohya_file(cfg: Config, plan: Plan, store: Store, lora: dict, layout: str = "kohya") -> Path:
    """The kohya file (layout "kohya"), or ComfyUI's layout of the family's model ("comfyui": export_comfyui.to_comfyui)."""
    tc = cfg.train
    key = key_of({"lora": lora["key"], "format": layout, "code": export.CODE_VERSION})
    if not store.valid(KOHYA_KIND, key):
        alpha = tc.alpha if tc.alpha is not None else tc.rank
        if tc.rslora:  # kohya loaders scale by alpha / rank: the alpha that gives rslora's alpha / sqrt(rank)
            alpha = alpha * tc.rank ** 0.5
        pairs = {k: v for k, v in lora["inputs"].items() if k.startswith("item:")}
        config = {k: v for k, v in lora["inputs"].items() if not k.startswith("item:")}
        te_lr = {"ss_text_encoder_lr": tc.text_encoder_lr} if tc.text_encoder_lr is not None else {}
        metadata = export.kohya_metadata(
            plan.family, tc.rank, alpha, ss_steps=tc.max_steps, ss_learning_rate=tc.lr, ss_seed=tc.seed,
            ss_num_train_images=len(pairs), ss_resolution=plan.size, ss_dataset_hash=key_of(pairs),
            ss_config_hash=key_of(config), loraflow_base_model=plan.ids["denoiser"], loraflow_train_key=lora["key"],
            **te_lr)
        denoiser, text_encoders = split_text_encoders(st.load_file(lora["lora"]))
        base = _base_weights(cfg, plan) if tc.network == "dora" else None  # each module's dora_scale
        with store.tmp_dir("publish") as tmp:
            if layout == "comfyui":
                path = export_comfyui.save_comfyui(Path(tmp) / "lora_comfyui.safetensors", plan.family, denoiser,
                                           tc.rank, alpha, {**metadata, "loraflow_layout": "comfyui"}, base)
            else:
                path = export.save_kohya(Path(tmp) / "lora_kohya.safetensors", plan.family, denoiser, tc.rank,
                                         alpha, metadata, text_encoders, base)
            store.put_file(KOHYA_KIND, key, path, meta={"lora": lora["key"]})
    return store.get_path(KOHYA_KIND, key)


def _base_weights(cfg: Config, plan: Plan):
    """module name -> the base denoiser's weight, loaded as training loads it (folder or single file)."""
    from tasks.models import make_adapter

    modules = dict(make_adapter(cfg.model, plan.model_dir).load_denoiser().named_modules())
    return lambda name: modules[name].weight.detach()


def lycoris_file(cfg: Config, plan: Plan, store: Store, lora: dict) -> Path:
    """train.network=loha|lokr: the LyCORIS file (export_lycoris.to_lycoris) of the train node's peft file."""
    tc = cfg.train
    key = key_of({"lora": lora["key"], "format": "lycoris", "code": export.CODE_VERSION})
    if not store.valid(LYCORIS_KIND, key):
        pairs = {k: v for k, v in lora["inputs"].items() if k.startswith("item:")}
        info = dict(ss_steps=tc.max_steps, ss_learning_rate=tc.lr, ss_seed=tc.seed,
                    ss_num_train_images=len(pairs), ss_resolution=plan.size, ss_dataset_hash=key_of(pairs),
                    ss_base_model_version=export.base_model_version(plan.family),
                    loraflow_base_model=plan.ids["denoiser"], loraflow_train_key=lora["key"])
        with store.tmp_dir("publish") as tmp:
            path = export_lycoris.save_lycoris(Path(tmp) / "lora_lycoris.safetensors", lora["lora"], info,
                                               plan.family)
            store.put_file(LYCORIS_KIND, key, path, meta={"lora": lora["key"]})
    return store.get_path(LYCORIS_KIND, key)


def diffusers_file(store: Store, lora: dict) -> Path:
    key = key_of({"lora": lora["key"], "format": "diffusers", "code": export.CODE_VERSION})
    if not store.valid(DIFFUSERS_KIND, key):
        with store.tmp_dir("publish") as tmp:
            path = export.save_diffusers(Path(tmp) / "pytorch_lora_weights.safetensors", lora["lora"])
            store.put_file(DIFFUSERS_KIND, key, path, meta={"lora": lora["key"]})
    return store.get_path(DIFFUSERS_KIND, key)


def publish(cfg: Config, plan: Plan, store: Store, run_dir: Path, lora: dict, samples: list[str]) -> dict:
    lora_dir = run_dir / "lora"
    lora_dir.mkdir(parents=True, exist_ok=True)
    fmt, files = cfg.export.format, {}
    if lycoris.is_lycoris(cfg.train):
        # LoHa/LoKr have one layout whatever export.format: LyCORIS's, in the names ComfyUI maps for the family
        # (tasks/training/export_lycoris.py); diffusers' load_lora_weights reads none (docs/lora-files.md)
        files["lycoris"] = files["comfyui"] = lora_dir / "lora_lycoris.safetensors"
        shutil.copyfile(lycoris_file(cfg, plan, store, lora), files["lycoris"])
        fmt = None
    if fmt in ("diffusers", "both"):
        # The file name diffusers' load_lora_weights(<dir>) looks for.
        files["diffusers"] = lora_dir / "pytorch_lora_weights.safetensors"
        shutil.copyfile(diffusers_file(store, lora), files["diffusers"])
    if fmt in ("kohya", "both"):
        files["kohya"] = lora_dir / "lora_kohya.safetensors"
        shutil.copyfile(kohya_file(cfg, plan, store, lora), files["kohya"])
    # Every run has a file ComfyUI's loader maps completely: the kohya file where it does, else (Z-Image) the
    # LoRA in ComfyUI's own layout (export_comfyui.to_comfyui)
    layout = "kohya" if export_comfyui.comfyui_loads_kohya(plan.family) else "comfyui"
    if "comfyui" in files:
        pass  # LoHa/LoKr: the LyCORIS file
    elif cfg.train.network == "dora" and cfg.train.text_encoder_lr is not None:
        pass  # the text encoders' DoRA has no kohya layout (tasks/validate.py): the diffusers file only
    elif layout == "kohya" and "kohya" in files:
        files["comfyui"] = files["kohya"]
    else:
        files["comfyui"] = lora_dir / f"lora_{layout}.safetensors"
        shutil.copyfile(kohya_file(cfg, plan, store, lora, layout), files["comfyui"])
    if lora.get("lora_ema"):  # train.ema_decay: the EMA weights, diffusers' layout (LoHa/LoKr: LyCORIS's)
        ema = {**lora, "key": key_of({"lora_ema": lora["key"]}), "lora": lora["lora_ema"]}
        if "lycoris" in files:
            files["ema"] = lora_dir / "lora_lycoris_ema.safetensors"
            shutil.copyfile(lycoris_file(cfg, plan, store, ema), files["ema"])
        else:
            files["ema"] = lora_dir / "pytorch_lora_weights_ema.safetensors"
            shutil.copyfile(diffusers_file(store, ema), files["ema"])
    out = run_dir / "samples"
    out.mkdir(exist_ok=True)
    paths = []
    for src, p in zip(samples, plan.prompts):
        dst = out / f"{p['line']:03d}_{slug(p['prompt'])}{Path(src).suffix}"  # .png, or a video family's .mp4
        shutil.copyfile(src, dst)
        paths.append(str(dst))
    labels = grid_labels(cfg, plan)
    grid = str(make_grid([Path(p) for p in paths], out / "grid.png", labels=labels)) \
        if paths and cfg.sample.grid else None
    main = files.get("lycoris") or files.get("diffusers") or files.get("kohya") or files["comfyui"]
    chart = loss_png(cfg, store, run_dir, lora)
    return {"lora": str(main), "lora_files": {k: str(v) for k, v in files.items()}, "samples": paths,
            "grid": grid, "sample_labels": [" · ".join(lines) for lines in labels][:len(paths)],
            "checkpoint_samples": _checkpoint_samples(out, lora.get("checkpoint_samples", {})),
            **({"loss_chart": str(chart)} if chart else {})}


def loss_png(cfg: Config, store: Store, run_dir: Path, lora: dict) -> Path | None:
    """<run dir>/loss.png: the loss per step and its running mean over train.log_every steps (the log line's
    mean), the validation loss, the learning rate of the run's schedule. Drawn once per LoRA and window and
    kept in the store: a run whose nodes are all cached copies it (no matplotlib, numpy or torch imported)."""
    losses = lora.get("step_losses") or []
    if not losses:
        return None
    tc = cfg.train
    key = key_of({"lora": lora["key"], "chart": charts.CODE_VERSION, "log_every": tc.log_every})
    if not store.valid(CHART_KIND, key):
        with store.tmp_dir("publish") as tmp:
            path = charts.loss_chart(Path(tmp) / "loss.png", losses, tc.log_every, charts.lr_schedule(tc, len(losses)),
                                     lora.get("validation_loss"))
            store.put_file(CHART_KIND, key, path, meta={"lora": lora["key"]})
    out = run_dir / "loss.png"
    shutil.copyfile(store.get_path(CHART_KIND, key), out)
    return out


def _checkpoint_samples(out: Path, rendered: dict[str, list[dict]]) -> dict[str, list[str]]:
    """Samples rendered during training, in samples/step_<k>/ (copied there as they were rendered; again
    here for steps restored from a checkpoint and for a cached train node)."""
    return {step: publish_step(out, step, entries)
            for step, entries in sorted(rendered.items(), key=lambda kv: int(kv[0]))}
