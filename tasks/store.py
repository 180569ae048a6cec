"""The content-addressed artifact store. Pure core: no Prefect.

Layout: ``<root>/<kind>/<key[:2]>/<key>/`` holds one entry: ``data<ext>`` and ``manifest.json``
(sha256 and size of the data, plus free metadata). An entry is written in ``<root>/tmp/`` and moved
into place with one ``rename``: a crash or kill leaves only debris in ``tmp/``, never a half entry.
Reads check the manifest's digest, so a truncated or flipped file is reported, never used.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from tasks.hashing import digest_file, digest_tree

MANIFEST = "manifest.json"


def _digest(data: Path) -> str:
    """A data file's sha256, or a folder's (a model) tree digest."""
    return digest_tree(data) if data.is_dir() else digest_file(data)


def _size(data: Path) -> int:
    if data.is_dir():
        return sum(p.stat().st_size for p in data.rglob("*") if p.is_file())
    return data.stat().st_size


class CorruptArtifact(Exception):
    """A stored entry failed verification; callers recompute it."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class Store:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(exist_ok=True)

    # -- locations -------------------------------------------------------------------------------
    def entry_dir(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / key

    def _data_path(self, entry: Path) -> Path:
        manifest = json.loads((entry / MANIFEST).read_text())
        return entry / manifest["file"]

    # -- writing ---------------------------------------------------------------------------------
    def put(self, kind: str, key: str, ext: str, write: Callable[[Path], None], meta: dict | None = None) -> Path:
        """Write an entry atomically. ``write(path)`` creates the data file at ``path``.

        Returns the final data path. If another writer committed the same key first, theirs is kept
        (same key, same content) and ours is discarded."""
        final = self.entry_dir(kind, key)
        tmp = self.root / "tmp" / f"{kind}-{key[:16]}-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        try:
            data = tmp / f"data{ext}"
            write(data)
            for f in ([data] if data.is_file() else sorted(p for p in data.rglob("*") if p.is_file())):
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
            manifest = {"kind": kind, "key": key, "file": data.name, "sha256": _digest(data),
                        "size": _size(data), "meta": meta or {}}
            _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            _fsync_dir(tmp)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                # A corrupt entry is moved aside first; a valid one means a concurrent writer won.
                if self.valid(kind, key):
                    shutil.rmtree(tmp, ignore_errors=True)
                    return self._data_path(final)
                self._discard(final)
            try:
                os.rename(tmp, final)
            except OSError:
                if not self.valid(kind, key):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            _fsync_dir(final.parent)
            return self._data_path(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def put_tensors(self, kind: str, key: str, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> Path:
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        return self.put(kind, key, ".safetensors", lambda p: save_file(tensors, str(p), metadata={"key": key}), meta)

    def put_file(self, kind: str, key: str, src: str | os.PathLike, meta: dict | None = None) -> Path:
        src = Path(src)
        return self.put(kind, key, src.suffix, lambda p: shutil.copyfile(src, p), meta)

    def put_json(self, kind: str, key: str, obj: Any, meta: dict | None = None) -> Path:
        text = json.dumps(obj, indent=1, sort_keys=True)
        return self.put(kind, key, ".json", lambda p: p.write_text(text), meta)

    # -- reading ---------------------------------------------------------------------------------
    def verify(self, kind: str, key: str) -> Path:
        """Path of the entry's data after checking size and digest; CorruptArtifact otherwise."""
        entry = self.entry_dir(kind, key)
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
            data = entry / manifest["file"]
            if manifest.get("key") != key:
                raise CorruptArtifact(f"{entry}: manifest names another key")
            if _size(data) != manifest["size"] or _digest(data) != manifest["sha256"]:
                raise CorruptArtifact(f"{data}: content does not match its manifest digest")
            return data
        except FileNotFoundError as e:
            raise CorruptArtifact(f"{entry}: missing {Path(e.filename).name if e.filename else 'file'}") from e
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptArtifact(f"{entry}: unreadable manifest ({e})") from e

    def exists(self, kind: str, key: str) -> bool:
        return (self.entry_dir(kind, key) / MANIFEST).is_file()

    def valid(self, kind: str, key: str) -> bool:
        try:
            self.verify(kind, key)
            return True
        except CorruptArtifact:
            return False

    def meta(self, kind: str, key: str) -> dict:
        return json.loads((self.entry_dir(kind, key) / MANIFEST).read_text()).get("meta", {})

    def get_tensors(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        path = self.verify(kind, key)
        try:
            return load_file(str(path))
        except Exception as e:  # a header that passed the digest but is not safetensors: treat as corrupt
            raise CorruptArtifact(f"{path}: not a safetensors file ({e})") from e

    def get_json(self, kind: str, key: str) -> Any:
        return json.loads(self.verify(kind, key).read_text())

    def get_path(self, kind: str, key: str) -> Path:
        return self.verify(kind, key)

    # -- repair ----------------------------------------------------------------------------------
    def _discard(self, entry: Path) -> None:
        """Move a corrupt entry out of the way (renamed first, so readers never see it half-deleted)."""
        trash = self.root / "tmp" / f"corrupt-{entry.name[:16]}-{uuid.uuid4().hex}"
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def discard(self, kind: str, key: str) -> None:
        self._discard(self.entry_dir(kind, key))

    # -- small mutable records (last run per config name) -----------------------------------------
    def write_record(self, name: str, obj: Any) -> None:
        path = self.root / "runs" / f"{name}.json"
        path.parent.mkdir(exist_ok=True)
        tmp = self.root / "tmp" / f"record-{uuid.uuid4().hex}.json"
        _write_bytes(tmp, json.dumps(obj, indent=1, sort_keys=True).encode())
        os.replace(tmp, path)

    def read_record(self, name: str) -> Any | None:
        path = self.root / "runs" / f"{name}.json"
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    # -- digests of big files (model weights), remembered by path, size and mtime like DVC does ---
    def file_digest(self, path: str | os.PathLike, min_size: int = 16 << 20) -> str:
        from tasks.hashing import key_of

        path = Path(path).resolve()
        st = path.stat()
        if st.st_size < min_size:
            return digest_file(path)
        memo = self.root / "filedigests" / (key_of({"path": str(path), "size": st.st_size,
                                                    "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}) + ".txt")
        try:
            return memo.read_text().strip()
        except FileNotFoundError:
            pass
        digest = digest_file(path)
        memo.parent.mkdir(exist_ok=True)
        tmp = self.root / "tmp" / f"fd-{uuid.uuid4().hex}"
        _write_bytes(tmp, digest.encode())
        os.replace(tmp, memo)
        return digest


def canonicalize_safetensors(path: str | os.PathLike) -> None:
    """Rewrite a .safetensors header in a canonical order, in place.

    safetensors keeps `__metadata__` in a Rust HashMap, so files with two or more metadata entries
    (diffusers' LoRA files, kohya's ss_* keys) come out in a different byte order from run to run. The
    tensors' bytes and offsets are unchanged; only the header's key order is fixed (sorted)."""
    path = Path(path)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: (header[k]["data_offsets"][0], k))
    ordered = {**({"__metadata__": header["__metadata__"]} if "__metadata__" in header else {}),
               **{k: header[k] for k in tensors}}
    raw = json.dumps(ordered, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    tmp = path.with_name(f".{path.name}.canon")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
