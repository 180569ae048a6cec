"""Masked loss (`data.mask_dir`, `data.alpha_mask`): which pixels of each image train.

A mask is a grayscale image by the image's stem in data.mask_dir (white trains, black does not; grey weighs in
between), or the image's own alpha channel. It goes through the image's own resize and crop (cover, centre
crop, bicubic: tasks/data/images.py) so that it lies on the pixels the latent was made from, and is cached per
item at that pixel size (uint8), keyed by the mask's bytes and the geometry only: a mask edit recomputes that
mask alone, and a VAE change none. The loss brings it to the latent grid (area average) and multiplies it into
the per-element loss, as sd-scripts' `apply_masked_loss` (library/train_util.py) does.
"""
from __future__ import annotations

import io
from pathlib import Path

from tasks.config_schema import DataConfig
from tasks.data.dataset import IMAGE_EXTS
from tasks.data.images import ImageLoadError, cover_crop
from tasks.lazy import lazy

torch = lazy("torch")
np, Image, ImageOps = lazy("numpy"), lazy("PIL.Image"), lazy("PIL.ImageOps")  # a no-op run reads no mask

PREFIX = "mask:"  # cache_latents' item key of an item's mask: "mask:<item name>" (the latent's is "<item name>")


def enabled(dc: DataConfig) -> bool:
    return bool(dc.mask_dir) or bool(dc.alpha_mask)


def file_by_stem(folder, image_name: str) -> Path | None:
    """The file in `folder` with image `image_name`'s relative path and stem, any image extension (a mask, a
    control image), or None."""
    stem = Path(folder) / Path(image_name).with_suffix("")
    for ext in IMAGE_EXTS:
        for candidate in (stem.with_name(stem.name + ext), stem.with_name(stem.name + ext.upper())):
            if candidate.is_file():
                return candidate
    return None


def _open(data: bytes, path) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return ImageOps.exif_transpose(im)
    except Exception as e:  # noqa: BLE001 - any decoder error: the mask is unusable, named
        raise ImageLoadError(Path(path), f"cannot decode the mask ({type(e).__name__}: {e})") from e


def mask_image(source: str, kind: str, data: bytes | None = None) -> Image.Image:
    """The mask as an 8-bit grayscale image: a mask file's luminance ("file"), or an image's alpha ("alpha"; an
    image without one trains everywhere, as sd-scripts' alpha_mask)."""
    raw = Path(source).read_bytes() if data is None else data
    img = _open(raw, source)
    if kind == "file":
        return img.convert("L")
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        return img.convert("RGBA").getchannel("A")
    return Image.new("L", img.size, 255)


def problem(source: str, kind: str, image_size: tuple[int, int]) -> str | None:
    """Why the mask of an image of `image_size` (w, h, upright) cannot be used, or None."""
    try:
        img = mask_image(source, kind)
    except (OSError, ImageLoadError) as e:
        return getattr(e, "reason", None) or f"cannot read the mask ({e})"
    if img.size != tuple(image_size):
        return f"mask {Path(source).name} is {img.size[0]}x{img.size[1]}, its image {image_size[0]}x{image_size[1]}"
    return None


def mask_pixels(img: Image.Image, width: int, height: int, flip: bool = False) -> torch.Tensor:
    """The mask through the image's resize and crop (tasks/data/images.py: image_to_tensor_and_geometry):
    uint8 [1, height, width]."""
    if flip:
        img = ImageOps.mirror(img)
    img = cover_crop(img, width, height)[0]
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())[None]


def on_latent_grid(masks: torch.Tensor, latent_hw) -> torch.Tensor:
    """uint8 [B, 1, H, W] pixel masks -> float [B, 1, h, w] weights in [0, 1] on the latent grid (area average,
    sd-scripts' interpolate(mode="area"))."""
    return torch.nn.functional.interpolate(masks.float() / 255.0, size=tuple(latent_hw), mode="area")


def attach(dc: DataConfig, plan_items: list[dict], items: list) -> tuple[list[dict], list[dict]]:
    """Each plan item with its mask (`mask`: the file, `mask_kind`: file | alpha, `mask_digest`: the bytes'
    digest). `items`: (dataset Item, plan name, subset) in plan order. Returns (the plan items that train,
    findings for those left out by data.bad_files=skip); with data.bad_files=error a missing or unusable mask
    is a ConfigError naming every one."""
    from tasks.config import ConfigError
    from tasks.store.hashing import digest_file

    if dc.mask_dir and dc.alpha_mask:
        raise ConfigError("data.mask_dir and data.alpha_mask=true: one mask per image; drop one of the two")
    if dc.mask_dir and not Path(dc.mask_dir).is_dir():
        raise ConfigError(f"data.mask_dir={dc.mask_dir}: no such folder; point it at the masks (one grayscale "
                          "image per training image, same stem: white trains)")
    kept, bad = [], []
    for entry, (it, name, _) in zip(plan_items, items):
        if dc.mask_dir:
            found = file_by_stem(dc.mask_dir, it.name)
            if found is None:
                bad.append((name, f"no mask {Path(it.name).with_suffix('')}.<{'|'.join(e[1:] for e in IMAGE_EXTS)}> "
                                  f"in data.mask_dir={dc.mask_dir}"))
                continue
            source, kind, digest = str(found), "file", None
        else:
            source, kind, digest = it.image_file, "alpha", entry["image_digest"]
        why = problem(source, kind, it.size)
        if why:
            bad.append((name, why))
            continue
        kept.append({**entry, "mask": source, "mask_kind": kind, "mask_digest": digest or digest_file(source)})
    if bad and dc.bad_files != "skip":
        lines = "\n".join(f"  - {n}: {why}" for n, why in bad)
        raise ConfigError(f"masked loss: {len(bad)} image(s) without a usable mask:\n{lines}\n  fix the masks, or "
                          "set data.bad_files=skip to leave these images out")
    if not kept:
        raise ConfigError(f"masked loss: none of the {len(plan_items)} image(s) has a usable mask (data.bad_files=skip "
                          f"left out every one), e.g. {bad[0][0]}: {bad[0][1]}")
    return kept, [{"file": n, "reason": why, "policy": "skipped"} for n, why in bad]
