"""Digests of big files (model weights) remembered by path, size, mtime and inode, DVC's trade-off: a file
rewritten in place with the same size and a restored mtime on the same inode keeps its old digest.
`store.rehash=true` digests every such file again (once per process) and rewrites its memo."""
from __future__ import annotations

import logging
from pathlib import Path

from tasks.store.hashing import digest_file, digest_text, key_of

log = logging.getLogger("loraflow")
_REHASHED: set[Path] = set()  # files digested again in this process under store.rehash=true


def memo_digest(store, path: Path, min_size: int) -> str:
    from tasks.store.repairs import note_repair

    st = path.stat()
    if st.st_size < min_size:
        return digest_file(path)
    memo = store.root / "filedigests" / (key_of({"path": str(path), "size": st.st_size,
                                                 "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}) + ".txt")
    if store.rehash and path not in _REHASHED:
        _REHASHED.add(path)
    else:
        try:  # "<digest> <check>": a torn or flipped memo is recomputed, never used
            parts = memo.read_text().split()
            if len(parts) == 2 and len(parts[0]) == 64 and parts[1] == digest_text(parts[0])[:16]:
                return parts[0]
            if not (len(parts) == 1 and len(parts[0]) == 64):  # a memo from before the check: just redone
                raise ValueError("check mismatch")
        except FileNotFoundError:
            pass
        except (ValueError, UnicodeDecodeError):
            log.warning("file digest memo %s is corrupt: digesting %s again", memo, path)
            note_repair(f"filedigests/{memo.stem}")
    digest = digest_file(path)
    store.write_small(memo, f"{digest} {digest_text(digest)[:16]}\n".encode(), f"a digest memo for {path}")
    return digest
