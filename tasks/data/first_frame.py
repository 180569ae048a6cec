"""Image-to-video conditioning (issue 47): which image each clip trains from, as a control entry of the plan.

An image-to-video family (its adapter's `controls.first_frame`) trains every clip with a condition image: by
default the clip's own first frame (data.condition_image=first_frame, or null), or a same-stem image beside the
clip (data.condition_image=beside: e.g. red.png for red.mp4, the still a user renders from). The condition is
cached by cache_latents like an edit pair's control (item `control:<clip>:0`), keyed by the bytes it is taken
from and the clip's frames, so a caption edit leaves it alone and a new first frame re-encodes that clip's alone.

Pure core, like the rest of tasks.data: no torch, no model."""
from __future__ import annotations

from pathlib import Path

from tasks.config_schema import Config, DataConfig
from tasks.data.masks import file_by_stem

SOURCES = ("first_frame", "beside")
IMAGE_IN_I2V = ("image: an image-to-video family trains clips, each from its first frame (a text-to-video family, "
                "e.g. model=tiny_wan, trains images as one-frame videos)")


def enabled(adapter_cls) -> bool:
    return adapter_cls.controls.first_frame


def errors(cfg: Config, adapter_cls) -> list[str]:
    """The conditioning options: a known source, and none on a family that renders from no image."""
    source, family = cfg.data.condition_image, cfg.model.family
    if source is None:
        return []
    if not enabled(adapter_cls):
        return [f"data.condition_image={source}: model.family={family} is not image-to-video; drop it, or train an "
                "image-to-video family (model=tiny_wan_i2v, tiny_wan22_i2v, tiny_wan22_ti2v, tiny_hunyuan_video15_i2v)"]
    if source not in SOURCES:
        return [f"data.condition_image={source!r}: choose first_frame (each clip's own) or beside (a same-stem "
                "image next to each clip)"]
    return []


def attach(dc: DataConfig, plan_items: list[dict], items: list) -> tuple[list[dict], list[dict], list[str]]:
    """Each clip's plan entry with `controls`: [[file, sha256]] (the clip itself for its first frame, or the image
    beside it) and `i2v`: {"from": ...}. `items`: (dataset Item, plan name, subset). Returns (the entries
    that train, the findings of files left out (images: conditions or not trainable here), the errors)."""
    from tasks.data.images import check_image
    from tasks.store.hashing import digest_file

    beside = dc.condition_image == "beside"
    clip_stems = {Path(it.image_file).with_suffix("") for it, _, _ in items if it.clip is not None}
    kept, left_out, errs = [], [], []
    for entry, (it, name, _) in zip(plan_items, items):
        if it.clip is None:
            why = (f"the condition image of {Path(name).stem} (data.condition_image=beside)"
                   if beside and Path(it.image_file).with_suffix("") in clip_stems else IMAGE_IN_I2V)
            left_out.append({"file": name, "reason": why, "policy": "ignored"})
            continue
        trains = entry["clip"]["frames"]
        if trains < dc.frames:
            errs.append(f"{name}: {trains} frame(s) at {entry['clip']['fps']:g} fps where data.frames={dc.frames}; an "
                        "image-to-video clip trains at its full length: lower data.frames or data.fps, or drop it")
            continue
        if not beside:
            kept.append({**entry, "controls": [[it.image_file, entry["image_digest"]]], "i2v": {"from": "first_frame"}})
            continue
        image = file_by_stem(Path(it.image_file).parent, Path(it.image_file).name)
        if image is None:
            errs.append(f"{name}: no condition image {Path(it.image_file).stem}.png (or .jpg, .webp) beside it "
                        "(data.condition_image=beside); add it, or use data.condition_image=first_frame")
            continue
        if reason := check_image(image):
            errs.append(f"{name}: condition image {image}: {reason}")
            continue
        size = _image_size(image)
        if tuple(size) != tuple(it.size):
            errs.append(f"{name}: condition image {image.name} is {size[0]}x{size[1]}, the clip {it.size[0]}x"
                        f"{it.size[1]}; it must be the clip's size (its first frame's), as the pipeline renders from it")
            continue
        kept.append({**entry, "controls": [[str(image), digest_file(image)]], "i2v": {"from": "beside"}})
    return kept, left_out, errs


def without_pair_notes(findings: list, items: list) -> list:
    """A clip and an image of its stem (its condition image, with data.condition_image=beside) are no twins that
    train with one caption: an image-to-video family trains no image, so the dataset's "same stem, one caption
    file" notes on such pairs are dropped (attach notes each image as left out instead)."""
    from tasks.data.dataset import SHARED_CAPTION

    stems = {str(Path(name).with_suffix("")) for it, name, _ in items if it.clip is not None}
    return [f for f in findings if not (f.policy == SHARED_CAPTION and str(Path(f.file).with_suffix("")) in stems)]


def _image_size(path) -> tuple[int, int]:
    from tasks.data.images import load_image

    return load_image(path).size
