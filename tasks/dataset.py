"""Scan and validate a kohya-style image folder (image + same-stem caption file).

Pure core: no prefect/hydra. Every problem is collected before failing, so a user
fixes a broken dataset in one pass instead of one error per run.
"""

from __future__ import annotations

import dataclasses

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MISSING_CAPTION_POLICIES = ("error", "empty")
MIN_IMAGE_SIDE = 16


class DatasetError(Exception):
    """The dataset cannot be used; the message lists every problem and the fix."""

    def __init__(self, message: str, problems: list[Problem] | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


class ImageLoadError(Exception):
    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


@dataclass(frozen=True)
class Problem:
    path: str  # relative to data_dir, posix
    reason: str
    kind: str = "other"  # picks the fix hint: missing_caption | caption | image | small | symlink


@dataclass(frozen=True)
class Item:
    name: str  # image path relative to data_dir, posix
    image_path: Path
    caption_path: Path | None
    caption: str
    size: tuple[int, int] | None = None  # (width, height) after EXIF orientation, once decoded


def _check_options(missing_caption: str, caption_extension: str) -> None:
    if missing_caption not in MISSING_CAPTION_POLICIES:
        raise ValueError(f"data.missing_caption={missing_caption!r} is invalid; "
                         f"allowed values: {', '.join(MISSING_CAPTION_POLICIES)}")
    if not caption_extension.startswith(".") or len(caption_extension) < 2:
        raise ValueError(f"data.caption_extension={caption_extension!r} is invalid; "
                         "it must start with a dot, e.g. '.txt'")


def _root(data_dir) -> Path:
    root = Path(data_dir)
    if not root.exists():
        raise DatasetError(f"data.dir={str(root)!r} does not exist; point data.dir at a folder of images")
    if not root.is_dir():
        raise DatasetError(f"data.dir={str(root)!r} is not a directory; point data.dir at a folder of images")
    return root


def _walk_images(root: Path, real_root: Path, problems: list[Problem]) -> list[Path]:
    """Image files under root, deterministic; refuses links that escape root."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for d in dirnames:  # os.walk does not descend into linked dirs; say so if they escape
            if (here / d).is_symlink() and not _inside(here / d, real_root):
                reason = "symlinked folder points outside data.dir (refused)"
                problems.append(Problem(_rel(here / d, root), reason, "symlink"))
        for f in sorted(filenames):
            if not f.startswith(".") and f.lower().endswith(IMAGE_EXTS):
                found.append(here / f)
    return found


def _inside(path: Path, real_root: Path) -> bool:
    return path.resolve().is_relative_to(real_root)


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _caption(img: Path, name: str, real_root: Path, policy: str, ext: str):
    """(caption text, caption path or None, problem or None) for one image."""
    cap = img.parent / (img.stem + ext)
    if not cap.is_file():
        missing = Problem(name, f"no caption file {cap.name}", "missing_caption")
        return "", None, missing if policy == "error" else None
    if not _inside(cap, real_root):
        return "", None, Problem(name, f"caption {cap.name} links outside data.dir (refused)", "symlink")
    try:
        # utf-8-sig: a BOM written by Windows editors is valid and must not end up in the caption.
        text = cap.read_bytes().decode("utf-8-sig").strip()
    except UnicodeDecodeError as e:
        return "", cap, Problem(name, f"caption {cap.name} is not valid UTF-8 (byte {e.start})", "caption")
    except OSError as e:
        return "", cap, Problem(name, f"caption {cap.name} cannot be read ({e.strerror or e})", "caption")
    if not text and policy == "error":
        return "", cap, Problem(name, f"caption file {cap.name} is empty", "missing_caption")
    return text, cap, None


def _scan(data_dir, missing_caption: str, caption_extension: str):
    """Candidates (item, its problems) plus dataset-level problems."""
    _check_options(missing_caption, caption_extension)
    root = _root(data_dir)
    real_root = root.resolve()
    problems: list[Problem] = []
    candidates: list[tuple[Item, list[Problem]]] = []
    for img in _walk_images(root, real_root, problems):
        name = _rel(img, root)
        if not _inside(img, real_root):
            problems.append(Problem(name, "symlink points outside data.dir (refused)", "symlink"))
            continue
        caption, cap_path, problem = _caption(img, name, real_root, missing_caption, caption_extension)
        candidates.append((Item(name, img, cap_path, caption), [problem] if problem else []))
    return root, candidates, problems


def scan_dataset(data_dir, missing_caption: str = "error",
                 caption_extension: str = ".txt") -> tuple[list[Item], list[Problem]]:
    """Find images and their captions without decoding pixels (cheap)."""
    _, candidates, problems = _scan(data_dir, missing_caption, caption_extension)
    items = [item for item, mine in candidates if not mine]
    problems += [p for _, mine in candidates for p in mine]
    return sorted(items, key=lambda i: i.name), sorted(problems, key=lambda p: p.path)


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to RGB the way a viewer would show it."""
    if img.mode.startswith("I;16") or img.mode == "I":
        # Pillow's convert() clips 16/32-bit values to 255 (all white); scale instead.
        arr = np.asarray(img).astype(np.float64)
        grey = np.clip(np.rint(arr / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")  # applies palette/tRNS transparency too
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if img.mode == "RGB":
        return img.copy()
    return img.convert("RGB")  # P, L, 1, CMYK, YCbCr, ...


def load_image(path) -> Image.Image:
    """Decode fully into an RGB image with EXIF orientation applied."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise ImageLoadError(path, "file is empty (0 bytes)")
        # Turn Pillow's bomb *warning* into an error too: a huge image would stall training.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                im.load()
                img = ImageOps.exif_transpose(im)
                return _to_rgb(img)
    except ImageLoadError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageLoadError(path, f"image too large, refused as a possible decompression bomb ({e})") from e
    except UnidentifiedImageError as e:
        raise ImageLoadError(path, "not a recognised image (wrong extension or corrupt header)") from e
    except OSError as e:
        msg = str(e)
        if "truncated" in msg:
            raise ImageLoadError(path, f"image data is truncated ({msg})") from e
        raise ImageLoadError(path, f"cannot read/decode image ({e.strerror or msg})") from e
    except Exception as e:  # decoders also raise SyntaxError/ValueError/... on corrupt data
        raise ImageLoadError(path, f"cannot decode image ({type(e).__name__}: {e})") from e


def _inspect(path) -> tuple[str | None, tuple[int, int] | None]:
    try:
        return None, load_image(path).size
    except ImageLoadError as e:
        return e.reason, None


def check_image(path) -> str | None:
    """None if the image decodes completely, else the reason it does not."""
    return _inspect(path)[0]


def image_to_tensor(img: Image.Image, width: int, height: int) -> torch.Tensor:
    """Cover-resize (keep aspect), centre-crop, return float32 [3,H,W] in [-1, 1]."""
    if width <= 0 or height <= 0:
        raise ValueError(f"target size must be positive, got {width}x{height}")
    if img.mode != "RGB":
        img = _to_rgb(img)
    w, h = img.size
    scale = max(width / w, height / h)
    nw, nh = max(width, round(w * scale)), max(height, round(h * scale))
    img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - width) // 2, (nh - height) // 2
    img = img.crop((left, top, left + width, top + height))
    arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


_HINTS = {
    "missing_caption": "missing captions: set data.missing_caption=empty to train such images "
                       "with an empty caption, or add <stem>{ext} next to each image",
    "caption": "caption files: re-save them as UTF-8 text",
    "image": "unreadable images: re-export them (PNG/JPEG/WebP/BMP) or remove them",
    "small": f"tiny images: use images at least {MIN_IMAGE_SIDE} px on each side or remove them",
    "symlink": "symlinks: copy the files into data.dir instead of linking outside it",
}


def validate_dataset(data_dir, missing_caption: str = "error",
                     caption_extension: str = ".txt") -> list[Item]:
    """Scan + decode every image; raise DatasetError listing every problem."""
    root, candidates, problems = _scan(data_dir, missing_caption, caption_extension)
    items = []
    for item, mine in candidates:
        reason, size = _inspect(item.image_path)
        if reason:
            mine.append(Problem(item.name, reason, "image"))
        elif min(size) < MIN_IMAGE_SIDE:
            mine.append(Problem(item.name, f"image is {size[0]}x{size[1]}, smaller than "
                                           f"{MIN_IMAGE_SIDE} px on a side", "small"))
        problems += mine
        if not mine:
            items.append(dataclasses.replace(item, size=tuple(size)))
    if problems:
        problems.sort(key=lambda p: p.path)
        kinds = {p.kind for p in problems}
        lines = [f"dataset data.dir={str(root)!r} has {len(problems)} problem(s):"]
        lines += [f"  {p.path}: {p.reason}" for p in problems]
        lines.append("to fix:")
        lines += [f"  - {_HINTS[k].format(ext=caption_extension)}" for k in _HINTS if k in kinds]
        raise DatasetError("\n".join(lines), problems)
    if not items:
        raise DatasetError(f"no usable images in data.dir={str(root)!r} (looked for "
                           f"{', '.join(IMAGE_EXTS)}, recursively); point data.dir at your image folder")
    return sorted(items, key=lambda i: i.name)
