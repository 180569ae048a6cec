"""Temporary entries under ``<store>/tmp``: named after the process that writes them, so that what a killed
process left there (a half-written latent, a LoRA being trained) can be told from a write in progress and
removed. Pure core: no Prefect."""
from __future__ import annotations

import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

log = logging.getLogger("loraflow")
SEP = "~"  # in no host name, kind or key
MAX_AGE_S = 24 * 3600  # a foreign host's entry (a shared store) is debris after a day: no write takes that long


def owner_prefix(what: str) -> str:
    """`<what>~<host>~<pid>~`: the start of a temporary name owned by this process."""
    return SEP.join((what, socket.gethostname(), str(os.getpid()), ""))


def fresh_name(what: str) -> str:
    return owner_prefix(what) + uuid.uuid4().hex


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def is_debris(name: str, mtime: float, now: float, max_age_s: float = MAX_AGE_S) -> bool:
    """An entry whose owner on this host has exited (one whose owner runs is kept, however old: a long
    training), or one older than `max_age_s` whose owner cannot be checked from here (another host
    sharing the store, or a name from an older loraflow, which carried no owner)."""
    parts = name.split(SEP)
    if len(parts) == 4 and parts[1] == socket.gethostname() and parts[2].isdigit():
        return int(parts[2]) != os.getpid() and not _alive(int(parts[2]))
    return now - mtime > max_age_s


def sweep(tmp: Path, max_age_s: float = MAX_AGE_S) -> tuple[int, int]:
    """Remove the debris in `tmp`; (entries, bytes) removed. Entries vanishing meanwhile (committed by
    their writer, or swept by another process) are skipped."""
    removed, size, now = 0, 0, time.time()
    try:
        names = os.listdir(tmp)
    except FileNotFoundError:
        return 0, 0
    for name in names:
        path = tmp / name
        try:
            if not is_debris(name, path.lstat().st_mtime, now, max_age_s):
                continue
            size += sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else \
                path.stat().st_size
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed += 1
        except FileNotFoundError:
            continue
    if removed:
        log.info("store: removed %d temporary entr%s (%.1f MiB) left by killed processes in %s", removed,
                 "y" if removed == 1 else "ies", size / 2**20, tmp)
    return removed, size
