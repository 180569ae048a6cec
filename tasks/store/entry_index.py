"""Which store entries were verified, with the stat signature their files had then: `dvc status`'s trade-off.

A no-op re-run over 100,000 items cannot read and digest every cached entry (about 0.1 ms each, plus the
manifest's parse). An entry is written once and never changed in place, so an entry whose data file and
manifest still have the size, mtime and inode they had when it was written or last verified is taken as
intact from two stat calls. Any write to either file (a truncation, a flipped byte written back, a
replaced manifest) changes its mtime or size, and the entry is verified in full again. What a stat cannot
see (a bit rotting on disk in place) is still caught where it matters: every read of an entry
(`Store.verify`) checks its digest.

Per kind, one file per first two hex digits of the key, `<store>/index/<kind>/<key[:2]>.json` (256 at most):
{key: [data file name, size, mtime_ns, ino, manifest size, mtime_ns, ino]} sealed with its digest
(tasks/store/hashing.py `sealed`). A run reads only the shards of the keys it checks, so a 12-item run costs the same in a store that
also holds 100,000 entries. Merged under one lock per kind when saved, so processes sharing a store (sweep
members, Dask workers) add to it; a torn or altered shard is ignored (its entries are verified again)."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from tasks.store.hashing import sealed, unseal

log = logging.getLogger("loraflow")


def _stat_sig(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def signature(entry: str, file: str) -> list | None:
    """[file, data size, mtime_ns, ino, manifest size, mtime_ns, ino] of an entry folder, or None."""
    data, manifest = _stat_sig(f"{entry}/{file}"), _stat_sig(f"{entry}/manifest.json")
    return None if data is None or manifest is None else [file, *data, *manifest]


class EntryIndex:
    def __init__(self, root: Path, kind: str):
        self.folder = root / "index" / kind
        self.kind = kind
        self._shards: dict[str, dict[str, list]] = {}  # shard name -> its entries, as read
        self._new: dict[str, list] = {}
        self._lock = threading.Lock()  # the store's background writer thread adds entries too

    def _path(self, shard: str) -> Path:
        return self.folder / f"{shard}.json"

    def _read(self, shard: str) -> dict[str, list]:
        path = self._path(shard)
        try:
            return unseal(path.read_bytes())
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError) as e:
            from tasks.store.repairs import note_repair

            log.warning("store index %s is unreadable (%s): its entries are verified again", path, e)
            note_repair(f"index/{self.kind}/{shard}")
            return {}

    def _known(self, key: str) -> list | None:
        shard = self._shards.get(key[:2])
        if shard is None:
            with self._lock:
                shard = self._shards.get(key[:2])
                if shard is None:
                    shard = self._shards[key[:2]] = self._read(key[:2])
        return shard.get(key)

    def intact(self, key: str, entry: str) -> bool:
        """True when the entry's files are as they were when it was last verified (two stat calls)."""
        sig = self._new.get(key) or self._known(key)
        return sig is not None and signature(entry, sig[0]) == sig

    def unchanged(self, keys, entry_of) -> list[str]:
        """The keys whose entries are as they were when last verified: intact() for many keys, in one tight
        loop (a no-op checks 200,000 of them)."""
        new, known, stat, out = self._new, self._known, os.stat, []
        for key in keys:
            sig = new.get(key) or known(key)
            if sig is None:
                continue
            entry = entry_of(key)
            try:
                d, m = stat(f"{entry}/{sig[0]}"), stat(f"{entry}/manifest.json")
            except OSError:
                continue
            if [sig[0], d.st_size, d.st_mtime_ns, d.st_ino, m.st_size, m.st_mtime_ns, m.st_ino] == sig:
                out.append(key)
        return out

    def add(self, key: str, entry: str, file: str) -> None:
        sig = signature(entry, file)
        if sig is not None:
            with self._lock:
                self._new[key] = sig

    def forget(self, key: str) -> None:
        with self._lock:
            self._new.pop(key, None)
            self._shards.get(key[:2], {}).pop(key, None)

    def save(self, write) -> None:
        """Merges this process's new signatures into their shards (under the kind's lock: concurrent savers keep
        each other's). `write(path, bytes)` replaces a file atomically."""
        with self._lock:
            if not self._new:
                return
            new, self._new = self._new, {}
        import fcntl

        by_shard: dict[str, dict[str, list]] = {}
        for key, sig in new.items():
            by_shard.setdefault(key[:2], {})[key] = sig
        self.folder.mkdir(parents=True, exist_ok=True)
        for legacy in (self.folder.with_suffix(".json"), self.folder.with_suffix(".lock")):  # one file a kind, before
            legacy.unlink(missing_ok=True)
        with open(self.folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for shard, added in sorted(by_shard.items()):
                entries = {**self._read(shard), **added}
                write(self._path(shard), sealed(entries))
                self._shards[shard] = entries
