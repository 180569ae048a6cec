"""Which store entries were verified, with the stat signature their files had then: `dvc status`'s trade-off.

A no-op re-run over 100,000 items cannot read and digest every cached entry (about 0.1 ms each, plus the
manifest's parse). An entry is written once and never changed in place, so an entry whose data file and
manifest still have the size, mtime and inode they had when it was written or last verified is taken as
intact from two stat calls. Any write to either file (a truncation, a flipped byte written back, a
replaced manifest) changes its mtime or size, and the entry is verified in full again. What a stat cannot
see (a bit rotting on disk in place) is still caught where it matters: every read of an entry
(`Store.verify`) checks its digest.

One file per kind, `<store>/index/<kind>.json`: {"entries": {key: [data file name, size, mtime_ns, ino, manifest
size, mtime_ns, ino]}, "check": digest of the entries}. Merged under a lock when saved, so processes sharing a
store (sweep members, Dask workers) add to it; a torn or altered index is ignored (entries are verified again)."""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from tasks.hashing import digest_text

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
        self.path = root / "index" / f"{kind}.json"
        self.kind = kind
        self._entries: dict[str, list] | None = None
        self._new: dict[str, list] = {}
        self._lock = threading.Lock()  # the store's background writer thread adds entries too

    def _read(self) -> dict[str, list]:
        try:
            raw = json.loads(self.path.read_bytes())
            entries = raw["entries"]
            if raw["check"] != digest_text(json.dumps(entries, sort_keys=True, separators=(",", ":"))):
                raise ValueError("its content does not match its digest")
            return entries
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError) as e:
            from tasks.store import _note_repair

            log.warning("store index %s is unreadable (%s): its entries are verified again", self.path, e)
            _note_repair(f"index/{self.kind}")
            return {}

    def intact(self, key: str, entry: str) -> bool:
        """True when the entry's files are as they were when it was last verified (two stat calls)."""
        if self._entries is None:
            with self._lock:
                if self._entries is None:
                    self._entries = self._read()
        sig = self._new.get(key) or self._entries.get(key)
        return sig is not None and signature(entry, sig[0]) == sig

    def unchanged(self, keys, entry_of) -> list[str]:
        """The keys whose entries are as they were when last verified: intact() for many keys, in one tight
        loop (a no-op checks 200,000 of them)."""
        self.intact("", "")  # loads the file once
        known, new, stat, out = self._entries, self._new, os.stat, []
        for key in keys:
            sig = new.get(key) or known.get(key)
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
            if self._entries:
                self._entries.pop(key, None)

    def save(self, write) -> None:
        """Merges this process's new signatures into the file (under a lock: concurrent savers keep each other's).
        `write(path, bytes)` replaces a file atomically."""
        with self._lock:
            if not self._new:
                return
            new, self._new = self._new, {}
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = {**self._read(), **new}
            text = json.dumps(entries, sort_keys=True, separators=(",", ":"))
            write(self.path, json.dumps({"check": digest_text(text), "entries": entries},
                                        sort_keys=True, separators=(",", ":")).encode())
        self._entries = entries
