"""``store.root`` as an fsspec URL: a store shared between machines (s3://, gs://, az://, memory://, ...).

A plain path or ``file://`` URL is the local store. Any other URL is a *remote*: entries are written to a
local working copy (``store.cache_dir``) exactly as in the local store (temp name, fsync, rename, verified
reads) and pushed to the remote after; a missing local entry is pulled from the remote on first use and
verified against its manifest like any other read, so a torn or tampered remote object is caught, discarded
and recomputed. On the remote, the manifest is uploaded last and removed first: an entry without one is
never read. Same key means same content, so concurrent writers of one item need no lock.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tasks.store.hashing import key_of
from tasks.store import MANIFEST, Store, StoreBackendMissing


def is_url(root: str) -> bool:
    return "://" in str(root)


def default_cache_dir(url: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "loraflow" / "stores" / key_of({"url": url})[:16]


def open_store(store_cfg) -> Store:
    """The store the config's store group names (tasks/config_schema.py StoreConfig: root, a path or URL;
    cache_dir, the local working copy or None; rehash). The store imports nothing of the config's."""
    root = str(store_cfg.root)
    if root.startswith("file://"):
        store = Store(root[len("file://"):])
    elif not is_url(root):
        store = Store(root)
    else:
        store = RemoteStore(root, store_cfg.cache_dir or default_cache_dir(root))
    store.rehash = bool(store_cfg.rehash)
    return store


class RemoteStore(Store):
    """A local store mirrored to an fsspec URL (pull on first read, push after each write)."""

    def __init__(self, url: str, cache_dir: str | os.PathLike):
        import fsspec

        super().__init__(cache_dir)
        self.url = url
        try:
            self.fs, self.base = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:  # e.g. s3:// without s3fs installed
            raise StoreBackendMissing(f"store.root={url!r}: {e}. Install the fsspec backend for this protocol "
                             f"(s3fs for s3://, gcsfs for gs://, adlfs for az://) or use a local folder") from e

    def _remote(self, kind: str, key: str) -> str:
        return f"{self.base.rstrip('/')}/{kind}/{key[:2]}/{key}"

    # -- reads: the local copy, else pulled from the remote, then verified as usual ---------------
    def exists(self, kind: str, key: str) -> bool:
        return super().exists(kind, key) or self.fs.exists(f"{self._remote(kind, key)}/{MANIFEST}")

    def verify(self, kind: str, key: str) -> Path:
        if not super().exists(kind, key):
            self._pull(kind, key)
        return super().verify(kind, key)

    def meta(self, kind: str, key: str) -> dict:
        if not super().exists(kind, key):
            self._pull(kind, key)
        return super().meta(kind, key)

    def _pull(self, kind: str, key: str) -> None:
        remote = self._remote(kind, key)
        if not self.fs.exists(f"{remote}/{MANIFEST}"):
            return
        tmp = self.tmp_path(f"pull-{key[:16]}")
        try:
            for src in self.fs.find(remote):
                dst = tmp / Path(src).relative_to(remote)
                dst.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(src, str(dst))
            final = self.entry_dir(kind, key)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, final)  # another reader may have pulled it first: keep theirs
            except OSError:
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # -- writes: local first (atomic), then pushed with the manifest last ------------------------
    def put(self, kind, key, ext, write, meta=None, **options) -> Path:
        data = super().put(kind, key, ext, write, meta, **options)
        remote = self._remote(kind, key)
        if not self.fs.exists(f"{remote}/{MANIFEST}"):
            entry = self.entry_dir(kind, key)
            files = sorted(p for p in entry.rglob("*") if p.is_file() and p.name != MANIFEST)
            for f in files + [entry / MANIFEST]:
                self.fs.put_file(str(f), f"{remote}/{f.relative_to(entry).as_posix()}")
        return data

    def discard(self, kind: str, key: str) -> None:
        super().discard(kind, key)
        remote = self._remote(kind, key)
        if self.fs.exists(f"{remote}/{MANIFEST}"):
            self.fs.rm_file(f"{remote}/{MANIFEST}")  # first: a half-deleted entry must not read as one
        if self.fs.exists(remote):
            self.fs.rm(remote, recursive=True)

    # -- plans and node results: Dask workers and sweep members on other machines read them by key ---
    def put_state(self, area: str, obj) -> str:
        key = super().put_state(area, obj)
        remote = f"{self.base.rstrip('/')}/flowstate/{area}/{key[:2]}/{key}.json"
        if not self.fs.exists(remote):
            self.fs.pipe_file(remote, self._state_path(area, key).read_bytes())
        return key

    def get_state(self, area: str, key: str):
        path = self._state_path(area, key)
        if not path.is_file():
            try:  # checked against its key by Store.get_state, like any local copy
                data = self.fs.cat_file(f"{self.base.rstrip('/')}/flowstate/{area}/{key[:2]}/{key}.json")
            except FileNotFoundError:
                data = None
            if data is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.write_small(path, data, f"the {area} record {key[:12]}")
        return super().get_state(area, key)

    # -- the last run per config name lives on the remote, so `changed` works across machines ----
    def write_record(self, name: str, obj) -> None:
        super().write_record(name, obj)
        self.fs.pipe_file(f"{self.base.rstrip('/')}/runs/{name}.json", json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_record(self, name: str):
        try:
            return json.loads(self.fs.cat_file(f"{self.base.rstrip('/')}/runs/{name}.json"))
        except (FileNotFoundError, ValueError):
            return super().read_record(name)
