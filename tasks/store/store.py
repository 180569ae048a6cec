"""The content-addressed artifact store. Pure core: no Prefect.

Layout: ``<root>/<kind>/<key[:2]>/<key>/`` holds one entry: ``data<ext>`` and ``manifest.json``
(sha256 and size of the data, plus free metadata). An entry is written in ``<root>/tmp/`` and moved
into place with one ``rename``: a crash or kill leaves only debris in ``tmp/``, never a half entry.
Reads check the manifest's digest, so a truncated or flipped file is reported, never used; the manifest
carries a digest of itself and the data's format is checked too (a safetensors header, a PNG signature), so a
file planted with a matching digest (a pickle, say) is refused as well. Every corrupt entry moved aside is
noted for the run report (`track_repairs`). A full disk is a `StoreFull` error that names the store.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from tasks.store import debris, stored_files
from tasks.store.entry_index import EntryIndex
from tasks.store.repairs import note_repair
from tasks.store.hashing import canonical_json, digest_bytes, digest_file, digest_text, digest_tree, key_of
from tasks.lazy import lazy

torch = lazy("torch")
st = lazy("safetensors.torch")

MANIFEST = "manifest.json"
_MANIFEST_FIELDS = {"kind", "key", "file", "sha256", "size", "meta"}
log = logging.getLogger("loraflow")


def _digest(data: Path) -> str:
    """A data file's sha256, or a folder's (a model) tree digest."""
    return digest_tree(data) if data.is_dir() else digest_file(data)


def _size(data: Path) -> int:
    if data.is_dir():
        return sum(p.stat().st_size for p in data.rglob("*") if p.is_file())
    return data.stat().st_size


class CorruptArtifact(Exception):
    """A stored entry failed verification; callers recompute it."""


class StoreBackendMissing(ValueError):
    """store.root is a URL whose fsspec backend is not installed (s3fs, gcsfs, adlfs): the user's to fix."""


class StoreFull(OSError):
    """The disk under the store filled up while writing an entry (nothing partial was kept)."""


def _disk_full(e: BaseException) -> bool:
    # safetensors reports an I/O error as SafetensorError("... No space left on device (os error 28)")
    return (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or \
        "No space left on device" in str(e) or "os error 28" in str(e)


def _manifest_check(manifest: dict) -> str:
    return key_of({k: v for k, v in manifest.items() if k != "check"})


def _read_manifest(entry: Path) -> dict:
    """The parsed manifest, after its self-check (a manifest written before the check existed has exactly the
    base fields); CorruptArtifact when it is unreadable or altered, FileNotFoundError when missing."""
    try:
        manifest = json.loads((entry / MANIFEST).read_bytes())
        fields = set(manifest)
        if fields != _MANIFEST_FIELDS and fields != _MANIFEST_FIELDS | {"check"}:
            raise ValueError(f"unexpected fields {sorted(fields ^ _MANIFEST_FIELDS)}")
        if "check" in manifest and manifest["check"] != _manifest_check(manifest):
            raise ValueError("the manifest's own digest does not match")
        return manifest
    except FileNotFoundError:
        raise
    except (ValueError, TypeError, AttributeError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptArtifact(f"{entry}: unreadable manifest ({e})") from e


def _check_format(data: Path) -> None:
    """The data's format beyond its digest (tasks/store/stored_files.py): a file planted with a matching manifest is refused."""
    try:
        stored_files.check_format(data)
    except stored_files.FormatError as e:
        raise CorruptArtifact(str(e)) from e


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
        self._indexes: dict[str, EntryIndex] = {}

    # -- locations -------------------------------------------------------------------------------
    def entry_dir(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / key

    def tmp_path(self, what: str) -> Path:
        """A fresh name under tmp/ that says which process owns it (see tasks/store/debris.py)."""
        return self.root / "tmp" / debris.fresh_name(what)

    def tmp_dir(self, what: str) -> tempfile.TemporaryDirectory:
        return tempfile.TemporaryDirectory(dir=self.root / "tmp", prefix=debris.owner_prefix(what))

    def sweep_debris(self) -> tuple[int, int]:
        """Remove what killed processes left under tmp/: (entries, bytes)."""
        return debris.sweep(self.root / "tmp")

    def _full(self, what: str, e: BaseException) -> StoreFull:
        try:
            free = f"{shutil.disk_usage(self.root).free / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        return StoreFull(errno.ENOSPC, f"the disk is full: no space left on device while writing {what} into the "
                         f"store {self.root} ({free}); nothing partial was kept. Free some space (or point store.root "
                         f"at a bigger disk) and run again: finished items are reused ({e})")

    # -- writing ---------------------------------------------------------------------------------
    def put(self, kind: str, key: str, ext: str, write: Callable[[Path], None], meta: dict | None = None,
            sha256: str | None = None, recomputable: bool = False) -> Path:
        """Write an entry atomically. ``write(path)`` creates the data file at ``path``; ``sha256``, when the
        caller has the bytes' digest already, saves reading the file back.

        The data and manifest are fsynced before the rename, always. ``recomputable`` entries (per-item
        caches) skip the two folder fsyncs, a third of an item's write time: a power cut can then lose the
        rename, never the content, and a lost entry is only recomputed (reads verify every entry anyway).

        Returns the final data path. If another writer committed the same key first, theirs is kept
        (same key, same content) and ours is discarded. A full disk raises StoreFull; either way nothing of
        this write is left behind (no entry, no temp folder)."""
        final = self.entry_dir(kind, key)
        tmp = self.tmp_path(f"{kind}-{key[:16]}")
        data = tmp / f"data{ext}"
        try:
            tmp.mkdir(parents=True)
            write(data)
            for f in ([data] if data.is_file() else sorted(p for p in data.rglob("*") if p.is_file())):
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
            manifest = {"kind": kind, "key": key, "file": data.name, "sha256": sha256 or _digest(data),
                        "size": _size(data), "meta": meta or {}}
            manifest = json.loads(json.dumps(manifest))  # the check covers what a reader will parse
            manifest["check"] = _manifest_check(manifest)
            _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            if not recomputable:
                _fsync_dir(tmp)
            final.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(3):
                try:
                    os.rename(tmp, final)  # fails while `final` holds an entry (ENOTEMPTY / EEXIST)
                    break
                except OSError:
                    if self.valid(kind, key):  # a concurrent writer won: same key, same content
                        return final / data.name
                    self._discard(final)  # a corrupt entry is moved aside, then ours goes in
            else:
                raise OSError(f"{final}: could not commit the entry")
            if not recomputable:
                _fsync_dir(final.parent)
            if data.suffix:  # a file entry (a model folder has no stat signature worth keeping)
                self._index(kind).add(key, str(final), data.name)
            return final / data.name
        except BaseException as e:
            if _disk_full(e):
                raise self._full(f"{kind} {key[:12]}", e) from e
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed; debris otherwise

    def put_tensors(self, kind: str, key: str, tensors: dict[str, torch.Tensor], meta: dict | None = None,
                    recomputable: bool = False) -> Path:
        # Serialized in memory (the bytes save_file writes): hashed there, written once, never read back.
        blob = st.save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata={"key": key})
        return self.put(kind, key, ".safetensors", lambda p: p.write_bytes(blob), meta,
                        sha256=hashlib.sha256(blob).hexdigest(), recomputable=recomputable)

    def put_file(self, kind: str, key: str, src: str | os.PathLike, meta: dict | None = None) -> Path:
        src = Path(src)
        return self.put(kind, key, src.suffix, lambda p: shutil.copyfile(src, p), meta)

    def put_json(self, kind: str, key: str, obj: Any, meta: dict | None = None) -> Path:
        text = json.dumps(obj, indent=1, sort_keys=True)
        return self.put(kind, key, ".json", lambda p: p.write_text(text), meta)

    # -- a flow's own bookkeeping: plans and node results, by the digest of their content -----------
    # Not artifacts (they name paths of this store and machine), so kept beside the entries, like run records.
    def _state_path(self, area: str, key: str) -> Path:
        return self.root / "flowstate" / area / key[:2] / f"{key}.json"

    def put_state(self, area: str, obj: Any) -> str:
        """Writes `obj` as JSON named by its content's sha256 (once; atomically); returns that key."""
        data = canonical_json(obj).encode()
        key = digest_bytes(data)
        path = self._state_path(area, key)
        if not path.is_file():
            path.parent.parent.mkdir(parents=True, exist_ok=True)
            self.write_small(path, data, f"the {area} record {key[:12]}")
        return key

    def get_state(self, area: str, key: str) -> Any:
        """The JSON put_state wrote under `key`, checked against it; CorruptArtifact when missing or altered."""
        path = self._state_path(area, key)
        try:
            data = path.read_bytes()
        except FileNotFoundError as e:
            raise CorruptArtifact(f"{path}: missing") from e
        if digest_bytes(data) != key:
            note_repair(f"flowstate/{area}/{key}")
            path.unlink(missing_ok=True)
            raise CorruptArtifact(f"{path}: content does not match its name")
        return json.loads(data)

    # -- reading ---------------------------------------------------------------------------------
    def verify(self, kind: str, key: str) -> Path:
        """Path of the entry's data after checking size and digest; CorruptArtifact otherwise."""
        entry = self.entry_dir(kind, key)
        try:
            manifest = _read_manifest(entry)
            data = entry / manifest["file"]
            if (manifest["key"], manifest["kind"]) != (key, kind) or Path(manifest["file"]).name != manifest["file"]:
                raise CorruptArtifact(f"{entry}: manifest names another entry")
            if _size(data) != manifest["size"] or _digest(data) != manifest["sha256"]:
                raise CorruptArtifact(f"{data}: content does not match its manifest digest")
            _check_format(data)
            return data
        except FileNotFoundError as e:
            raise CorruptArtifact(f"{entry}: missing {Path(e.filename).name if e.filename else 'file'}") from e
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptArtifact(f"{entry}: unreadable entry ({e})") from e

    def _index(self, kind: str) -> EntryIndex:
        if kind not in self._indexes:
            self._indexes[kind] = EntryIndex(self.root, kind)
        return self._indexes[kind]

    def intact(self, kind: str, key: str) -> bool:
        """valid(), answered from two stat calls when the entry's files are as they were when last verified
        (tasks/store/entry_index.py); entries verified here are remembered for the next run (save_indexes)."""
        entry = f"{self.root}/{kind}/{key[:2]}/{key}"  # = entry_dir, without pathlib's cost (100,000 entries)
        index = self._index(kind)
        if index.intact(key, entry):
            return True
        try:
            data = self.verify(kind, key)
        except CorruptArtifact:
            return False
        if data.is_file():
            index.add(key, entry, data.name)
        return True

    def unchanged(self, kind: str, keys) -> set[str]:
        """The keys whose entries are as they were when last written or verified, in one pass of stat calls
        (no entry is read); intact() answers the others."""
        root = str(self.root)
        return set(self._index(kind).unchanged(keys, lambda k: f"{root}/{kind}/{k[:2]}/{k}"))

    def all_intact(self, kind: str, keys) -> bool:
        keys = list(dict.fromkeys(keys))
        seen = self.unchanged(kind, keys)
        return all(k in seen or self.intact(kind, k) for k in keys)

    def save_indexes(self) -> None:
        """Writes what this process verified or wrote into the store's index (tasks/store/entry_index.py)."""
        for index in self._indexes.values():
            index.save(lambda path, data: self.write_small(path, data,
                                                            f"the store index {path.parent.name}/{path.name}"))

    def exists(self, kind: str, key: str) -> bool:
        return (self.entry_dir(kind, key) / MANIFEST).is_file()

    def valid(self, kind: str, key: str) -> bool:
        try:
            self.verify(kind, key)
            return True
        except CorruptArtifact:
            return False

    def meta(self, kind: str, key: str) -> dict:
        return _read_manifest(self.entry_dir(kind, key)).get("meta", {})

    def get_tensors(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        path = self.verify(kind, key)
        try:
            return st.load_file(str(path))
        except Exception as e:  # a header that passed the digest but is not safetensors: treat as corrupt
            raise CorruptArtifact(f"{path}: not a safetensors file ({e})") from e

    def tensor_shapes(self, kind: str, key: str) -> dict[str, list[int]]:
        """Name -> shape of a verified safetensors entry, from its header (the tensors are not loaded)."""
        return {k: v["shape"] for k, v in stored_files.safetensors_header(self.verify(kind, key)).items()
                if k != "__metadata__"}

    def get_json(self, kind: str, key: str) -> Any:
        return json.loads(self.verify(kind, key).read_text())

    def get_path(self, kind: str, key: str) -> Path:
        return self.verify(kind, key)

    # -- repair ----------------------------------------------------------------------------------
    def _discard(self, entry: Path) -> None:
        """Move a corrupt entry out of the way (renamed first, so readers never see it half-deleted)."""
        if entry.parent.parent.name in self._indexes:
            self._indexes[entry.parent.parent.name].forget(entry.name)
        trash = self.tmp_path(f"corrupt-{entry.name[:16]}")
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)
        note_repair(f"{entry.parent.parent.name}/{entry.name}")

    def discard(self, kind: str, key: str) -> None:
        self._discard(self.entry_dir(kind, key))

    # -- small mutable records (last run per config name) -----------------------------------------
    def write_small(self, path: Path, data: bytes, what: str) -> None:
        """A small file replaced atomically (temp file, fsync, rename); StoreFull when the disk is full."""
        tmp = self.tmp_path(path.parent.name)
        try:
            path.parent.mkdir(exist_ok=True)
            _write_bytes(tmp, data)
            os.replace(tmp, path)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if _disk_full(e):
                raise self._full(what, e) from e
            raise

    def write_record(self, name: str, obj: Any) -> None:
        """The record carries the digest of its content: a torn or flipped one reads as no record. Compact JSON:
        indented, Python's json takes its slow pure-Python encoder (seconds for 100,000 items' inputs)."""
        text = json.dumps(obj, sort_keys=True)
        body = json.dumps({"record": json.loads(text), "sha256": digest_text(text)}, sort_keys=True)
        self.write_small(self.root / "runs" / f"{name}.json", body.encode(), f"the run record {name}")

    def read_record(self, name: str) -> Any | None:
        """The last run's record, or None: none yet, or a corrupt one (a warning; the run goes on as a first run)."""
        path = self.root / "runs" / f"{name}.json"
        try:
            obj = json.loads(path.read_bytes())
            if isinstance(obj, dict) and ("sha256" in obj or "record" in obj):
                if set(obj) != {"record", "sha256"}:
                    raise ValueError("its content does not match its digest")
                if digest_text(json.dumps(obj["record"], sort_keys=True)) != obj["sha256"]:
                    if digest_text(json.dumps(obj["record"], indent=1, sort_keys=True)) != obj["sha256"]:
                        raise ValueError("its content does not match its digest")
                    self.write_record(name, obj["record"])  # the indented form of before: written compact, once
                return obj["record"]
            if not isinstance(obj, dict):  # records written before the digest are plain dicts
                raise ValueError("not a JSON object")
            return obj
        except FileNotFoundError:
            return None
        except ValueError as e:
            log.warning("run record %s is corrupt (%s): treated as no previous run", path, e)
            note_repair(f"runs/{name}")
            return None

    # -- digests of big files (model weights), remembered by path, size, mtime and inode like DVC does ---
    rehash = False  # store.rehash=true: each big file digested again (once per process), its memo rewritten

    def file_digest(self, path: str | os.PathLike, min_size: int = 16 << 20) -> str:
        from tasks.store.filedigests import memo_digest

        return memo_digest(self, Path(path).resolve(), min_size)
