"""What a stored file must look like beyond its digest (a safetensors header that accounts for every byte, a PNG
signature, JSON, never a pickle), and the canonical byte order of a safetensors header. Pure core: the store
(tasks/store/store.py) turns a FormatError into CorruptArtifact, and the entry is recomputed."""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

# Formats that unpickle (run code) when loaded: never part of a stored entry.
_PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"}
_PNG = b"\x89PNG\r\n\x1a\n"


class FormatError(ValueError):
    """A stored file is not what its name says."""


def _check_safetensors(path: Path) -> None:
    """A safetensors header that parses and accounts for every byte of the file (a pickle never does)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        if n is None or n > size - 8:
            raise FormatError(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
            end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"], default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise FormatError(f"{path}: not a safetensors file (bad header: {e})") from e
    if 8 + n + end != size:
        raise FormatError(f"{path}: not a safetensors file (header and size disagree)")


def check_format(data: Path) -> None:
    """The data's format, beyond its digest: a file planted with a matching manifest is refused, never loaded."""
    files = sorted(p for p in data.rglob("*") if p.is_file()) if data.is_dir() else [data]
    for f in files:
        if f.suffix in _PICKLE_SUFFIXES:
            raise FormatError(f"{f}: a pickle-format file in a store entry (refused, never loaded)")
        if f.suffix == ".safetensors":
            _check_safetensors(f)
        elif f.suffix == ".png":
            with open(f, "rb") as fh:
                if fh.read(8) != _PNG:
                    raise FormatError(f"{f}: not a PNG file")
        elif f.suffix == ".mp4":
            with open(f, "rb") as fh:
                if fh.read(8)[4:] != b"ftyp":  # an ISO media file starts with its ftyp box
                    raise FormatError(f"{f}: not an mp4 file")
        elif f.suffix == ".json" and not data.is_dir():
            try:
                json.loads(f.read_bytes())
            except ValueError as e:
                raise FormatError(f"{f}: not a JSON file ({e})") from e


def safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes, offsets; `__metadata__`), tensors unread."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def canonicalize_safetensors(path: str | os.PathLike) -> None:
    """Rewrite a .safetensors header in a canonical order, in place (a file not yet published: a temp name).

    safetensors keeps `__metadata__` in a Rust HashMap, so files with two or more metadata entries
    (diffusers' LoRA files, kohya's ss_* keys) come out in a different byte order from run to run. The
    tensors' bytes and offsets are unchanged; only the header's key order is fixed (sorted). The same keys in
    another order are as long (compact JSON, as safetensors writes it), so only the header is written again: a
    merged 12 B base (24 GB) is neither read into memory nor copied. A header of another length (non-ASCII
    metadata, which Python escapes) is written to a new file with the tensors copied in chunks, then renamed."""
    path = Path(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        old = f.read(n)
    header = json.loads(old)
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: (header[k]["data_offsets"][0], k))
    ordered = {**({"__metadata__": header["__metadata__"]} if "__metadata__" in header else {}),
               **{k: header[k] for k in tensors}}
    raw = json.dumps(ordered, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    if raw == old:
        return
    if len(raw) == n:
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        return
    tmp = path.with_name(f".{path.name}.canon")
    with open(path, "rb") as src, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        src.seek(8 + n)
        shutil.copyfileobj(src, f, 16 << 20)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
