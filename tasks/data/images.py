"""Decode one image file into RGB pixels, saying what had to be converted on the way.

Pure core: no prefect/hydra. `decode_image` is the single decode both the dataset check (which records
the conversion notes) and cache_latents (which wants the pixels) go through, so they cannot disagree.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from tasks.lazy import lazy

# numpy and PIL too: a no-op run decodes no image (tasks/lazy.py)
np, Image, ImageOps = lazy("numpy"), lazy("PIL.Image"), lazy("PIL.ImageOps")
torch = lazy("torch")

# (reason, policy): why a file was not used as stored, and what was done about it.
Note = tuple[str, str]

_ORIENTATION = {2: "mirrored", 3: "rotated 180°", 4: "flipped vertically", 5: "mirrored and rotated 90°",
                6: "rotated 90°", 7: "mirrored and rotated 270°", 8: "rotated 270°"}
_MODE_NAMES = {"CMYK": "CMYK image", "L": "greyscale image", "P": "palette image", "1": "1-bit (black/white) image",
               "YCbCr": "YCbCr image", "LAB": "Lab image", "HSV": "HSV image", "F": "32-bit float image"}


class ImageLoadError(Exception):
    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


def convert_to_rgb(img: Image.Image) -> tuple[Image.Image, list[Note]]:
    """RGB the way a viewer would show it, plus a note for each conversion that was needed."""
    mode = img.mode
    if mode.startswith("I;16") or mode == "I":
        # Pillow's convert() clips 16/32-bit values to 255 (all white); scale instead.
        arr = np.asarray(img).astype(np.float64)
        grey = np.clip(np.rint(arr / 257.0), 0, 255).astype(np.uint8)
        return (Image.fromarray(grey, "L").convert("RGB"),
                [(f"16-bit greyscale image (mode {mode})", "scaled to 8-bit, converted to RGB")])
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")  # applies palette/tRNS transparency too
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        what = _MODE_NAMES.get(mode, f"{mode} image")
        what = f"{what} with transparency" if "transparency" in img.info else f"image with an alpha channel (mode {mode})"
        return Image.alpha_composite(white, rgba).convert("RGB"), [(what, "composited on white, converted to RGB")]
    if mode == "RGB":
        return img.copy(), []
    # P, L, 1, CMYK, YCbCr, ...
    return img.convert("RGB"), [(f"{_MODE_NAMES.get(mode, 'image')} (mode {mode})", "converted to RGB")]


def _to_rgb(img: Image.Image) -> Image.Image:
    return convert_to_rgb(img)[0]


def _depth_notes(im: Image.Image) -> list[Note]:
    """16 bits per channel colour (Pillow reduces it to 8 while decoding; only the raw mode tells)."""
    for tile in im.tile or ():
        rawmode = tile.args if isinstance(tile.args, str) else (tile.args or ("",))[0]
        if im.mode in ("RGB", "RGBA") and isinstance(rawmode, str) and ";16" in rawmode:
            return [(f"16-bit colour image ({rawmode})", "reduced to 8 bits per channel")]
    return []


def decode_image(path, data: bytes | None = None) -> tuple[Image.Image, list[Note]]:
    """Decode fully into an RGB image with EXIF orientation applied; notes say what was converted. With
    `data`, those bytes (already read from `path`) are decoded, not the file."""
    path = Path(path)
    try:
        if (len(data) if data is not None else path.stat().st_size) == 0:
            raise ImageLoadError(path, "file is empty (0 bytes)")
        # Turn Pillow's bomb *warning* into an error too: a huge image would stall training.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path if data is None else io.BytesIO(data)) as im:
                notes = _depth_notes(im)
                im.load()
                orientation = im.getexif().get(0x0112, 1)
                img = ImageOps.exif_transpose(im)
                if orientation in _ORIENTATION:
                    notes.append((f"EXIF orientation {orientation} (stored {_ORIENTATION[orientation]})",
                                  "orientation applied (turned upright)"))
                rgb, converted = convert_to_rgb(img)
                return rgb, notes + converted
    except ImageLoadError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageLoadError(path, f"image too large, refused as a possible decompression bomb ({e})") from e
    except Image.UnidentifiedImageError as e:
        raise ImageLoadError(path, "not a recognised image (wrong extension or corrupt header)") from e
    except OSError as e:
        msg = str(e)
        if "truncated" in msg.lower():
            raise ImageLoadError(path, f"image data is truncated ({msg})") from e
        raise ImageLoadError(path, f"cannot read/decode image ({e.strerror or msg})") from e
    except Exception as e:  # decoders also raise SyntaxError/ValueError/... on corrupt data
        raise ImageLoadError(path, f"cannot decode image ({type(e).__name__}: {e})") from e


def load_image(path) -> Image.Image:
    """Decode fully into an RGB image with EXIF orientation applied."""
    return decode_image(path)[0]


def read_image(path) -> tuple[Image.Image, str]:
    """The image and the sha256 of the very bytes decoded (the file is read once): what is encoded is
    what the digest names, even if the file changes meanwhile."""
    from tasks.store.hashing import digest_bytes

    data = Path(path).read_bytes()
    return decode_image(path, data)[0], digest_bytes(data)


def inspect_image(path) -> tuple[str | None, tuple[int, int] | None, list[Note]]:
    """(reason it cannot be used or None, size, conversion notes) from one decode."""
    try:
        img, notes = decode_image(path)
        return None, img.size, notes
    except ImageLoadError as e:
        return e.reason, None, []


def check_image(path) -> str | None:
    """None if the image decodes completely, else the reason it does not."""
    return inspect_image(path)[0]


def image_to_tensor(img: Image.Image, width: int, height: int) -> torch.Tensor:
    """Cover-resize (keep aspect), centre-crop, return float32 [3,H,W] in [-1, 1]."""
    return image_to_tensor_and_geometry(img, width, height)[0]


def cover_crop(img: Image.Image, width: int, height: int) -> tuple[Image.Image, int, int]:
    """The training geometry: resized (bicubic) to cover (width, height), then centre-cropped; with the crop's
    (top, left) in the resized image. Masks and control images go through it like their images."""
    w, h = img.size
    scale = max(width / w, height / h)
    nw, nh = max(width, round(w * scale)), max(height, round(h * scale))
    img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - width) // 2, (nh - height) // 2
    return img.crop((left, top, left + width, top + height)), top, left


def image_to_tensor_and_geometry(img: Image.Image, width: int, height: int) -> tuple[torch.Tensor, dict]:
    """image_to_tensor, plus what SDXL's size conditioning needs: the image's size before resizing
    (`original_size`, h, w) and the crop's offsets in the resized image (`crop_top_left`, top, left), as
    diffusers' SDXL LoRA example and sd-scripts record them."""
    if width <= 0 or height <= 0:
        raise ValueError(f"target size must be positive, got {width}x{height}")
    if img.mode != "RGB":
        img = _to_rgb(img)
    w, h = img.size
    img, top, left = cover_crop(img, width, height)
    arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    geometry = {"original_size": torch.tensor([h, w]), "crop_top_left": torch.tensor([top, left])}
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous(), geometry
