"""Edit pairs (`data.control_dirs`) and control images of sample prompts (`--i`): which control image(s) go with
each training image and each sample prompt, by content.

A training image's control images are the files with its relative path and stem in each of data.control_dirs,
in the order of the list (the kohya / musubi-tuner convention). Each is resized and centre-cropped to its
target's training size and cached as a latent like the target (cache_latents: item `control:<image>:<k>`),
keyed by its bytes: a control edit encodes that control alone. diffusers' Kontext training example resizes a
pair's control image with its target's transforms; so does this, and FLUX.2's references train so too. A
family whose pipeline resizes the images it is given (Qwen-Image-Edit: about 1 MP for its VAE, 384x384 for its
text encoder) gets the fitted image resized again as its pipeline does (the adapter's `control_size`), so
training sees what sampling from the same fitted image sees.
"""
from __future__ import annotations

from pathlib import Path

from tasks.config_schema import Config, DataConfig
from tasks.data.images import check_image, cover_crop, load_image
from tasks.data.masks import file_by_stem
from tasks.lazy import lazy

Image = lazy("PIL.Image")  # a no-op run opens no control image (tasks/lazy.py)

PREFIX = "control:"  # cache_latents' item key of an item's k-th control: "control:<item name>:<k>"


def item_name(name: str, k: int) -> str:
    return f"{PREFIX}{name}:{k}"


def errors(dc: DataConfig, family: str, adapter_cls) -> list[str]:
    dirs, max_controls = list(dc.control_dirs or []), adapter_cls.controls.most
    if dirs and not max_controls:
        return [f"data.control_dirs: model.family={family} takes no control image; an edit family does "
                "(tiny_flux_kontext, tiny_qwenimage_edit, the flux2 models): set data.control_dirs=[] or pick one"]
    if len(dirs) > max_controls:
        return [f"data.control_dirs has {len(dirs)} folders; model.family={family} takes at most {max_controls} "
                "control image(s) per sample"]
    out = []
    if not dirs and adapter_cls.controls.required and not adapter_cls.controls.first_frame:
        out.append(f"model.family={family} edits an image: set data.control_dirs=[DIR] (control images by the "
                   "targets' stems)")
    if dc.flip_aug and adapter_cls.controls.seen_by_text:  # a twin's text would need its mirrored controls
        out.append(f"data.flip_aug with model.family={family}: its prompt embedding sees the control image, which "
                   "a flip would change; set data.flip_aug=false")
    return out


def attach(dc: DataConfig, plan_items: list[dict], items: list) -> tuple[list[dict], list[dict]]:
    """Each plan item with `controls`: [[file, sha256], ...] in data.control_dirs' order. `items`: (dataset Item,
    plan name, subset). Returns (the items that train, findings of those left out by data.bad_files=skip); with
    data.bad_files=error a missing or unreadable control image is a ConfigError naming every one."""
    from tasks.config import ConfigError
    from tasks.store.hashing import digest_file

    missing = [d for d in dc.control_dirs if not Path(d).is_dir()]
    if missing:
        raise ConfigError(f"data.control_dirs: {', '.join(map(str, missing))}: no such folder; point it at the "
                          "control images (one per training image, same stem)")
    kept, bad = [], []
    for entry, (it, name, _) in zip(plan_items, items):
        found, why = [], None
        for folder in dc.control_dirs:
            f = file_by_stem(folder, it.name)
            if f is None:
                why = f"no control image {Path(it.name).with_suffix('')}.* in {folder} (data.control_dirs)"
                break
            if reason := check_image(f):
                why = f"control image {f}: {reason}"
                break
            found.append([str(f), digest_file(f)])
        if why:
            bad.append((name, why))
        else:
            kept.append({**entry, "controls": found})
    if bad and dc.bad_files != "skip":
        lines = "\n".join(f"  - {n}: {why}" for n, why in bad)
        raise ConfigError(f"edit pairs: {len(bad)} image(s) without a usable control image:\n{lines}\n  add or fix "
                          "them, or set data.bad_files=skip to leave these images out")
    if not kept:
        raise ConfigError(f"edit pairs: no image has a usable control image, e.g. {bad[0][0]}: {bad[0][1]}")
    return kept, [{"file": n, "reason": why, "policy": "skipped"} for n, why in bad]


def prompt_images(p, prompts_file) -> dict:
    """A sample prompt's `--i` images as plan entries ({"images": [[file, sha256], ...]}; {} without --i), each
    path relative to the prompts file's folder unless absolute."""
    from tasks.config import ConfigError
    from tasks.store.hashing import digest_file

    out = []
    for raw in p.images:
        f = Path(raw).expanduser()
        f = f if f.is_absolute() else Path(prompts_file).parent / f
        if reason := (check_image(f) if f.is_file() else "no such file"):
            raise ConfigError(f"sample.prompts_file={prompts_file}:{p.line}: --i {raw}: {reason}")
        out.append([str(f.resolve()), digest_file(f)])
    return {"images": out} if out else {}


def prompt_errors(prompts: list[dict], cfg: Config, size, adapter_cls) -> list[str]:
    """What is wrong with the sample prompts' --i images for this family (none, too many, too small)."""
    out, family, sc = [], cfg.model.family, cfg.sample
    takes = adapter_cls.controls
    if takes.required:
        does = "renders a clip from its first frame" if takes.first_frame else "edits an image"
        out += [f"sample.prompts_file={sc.prompts_file}:{p['line']}: model.family={family} {does}: give "
                "it one with --i PATH" for p in prompts if not p.get("images")]
    for p in (p for p in prompts if p.get("images")):
        where = f"sample.prompts_file={sc.prompts_file}:{p['line']}: --i"
        w, h = p["width"] or sc.width or size[0], p["height"] or sc.height or size[1]
        if not takes.most:
            out.append(f"{where} gives a control image, which model.family={family} does not take; remove --i or "
                       "train an edit family")
        elif len(p["images"]) > takes.most:
            out.append(f"{where}: {len(p['images'])} images; model.family={family} takes {takes.most}")
        elif min(w, h) < takes.min_side:  # FLUX.2's image processor refuses smaller references
            out.append(f"{where}: the control is fitted to the sample's {w}x{h}, under the {takes.min_side}"
                       f" px a side model.family={family} takes; use --w/--h or sample.width/height of "
                       f"{takes.min_side} or more")
    return out


def stacked(per_item: list[list[dict]]) -> dict:
    """The control entries of a batch's items (each a list of stored dicts, one per control) as the adapters read
    them: "control_latents" [B, K, ...] and, for what else an entry holds (Wan 2.1 I2V's CLIP image embedding),
    "control_<name>" [B, K, ...]."""
    import torch

    return {("control_latents" if name == "latents" else f"control_{name}"):
            torch.stack([torch.stack([entry[name] for entry in entries]) for entries in per_item])
            for name in per_item[0][0]}


def fitted(path: str, width: int, height: int) -> Image.Image:
    """A control image resized to cover (width, height) and centre-cropped, as its target trains (bicubic)."""
    return fitted_image(load_image(path), width, height)


def fitted_image(img: Image.Image, width: int, height: int) -> Image.Image:
    return cover_crop(img, width, height)[0]


def resized(img: Image.Image, size, resize_to) -> Image.Image:
    """A control image fitted to its target's `size`, then resized to `resize_to` as diffusers'
    VaeImageProcessor.resize does a PIL image in the pipelines that resize their controls (Lanczos): what the
    pipeline makes of the fitted image it is given when sampling."""
    return cover_crop(img.convert("RGB"), *size)[0].resize(tuple(resize_to), Image.Resampling.LANCZOS)


def beside(controls: list[Image.Image], image: Image.Image) -> Image.Image:
    """The sample as saved: its control image(s), then the result, side by side."""
    tiles = [*controls, image]
    out = Image.new("RGB", (sum(t.width for t in tiles), max(t.height for t in tiles)), "white")
    x = 0
    for t in tiles:
        out.paste(t.convert("RGB"), (x, 0))
        x += t.width
    return out
