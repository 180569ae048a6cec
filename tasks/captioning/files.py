"""Caption files outside the store: `<run dir>/captions/<item>.txt` for every image a model captioned, and,
with caption.beside_images=true, `<stem><ext>` next to the image. loraflow records what it wrote beside the
images in the folder's `.loraflow-captions.json` (caption file -> sha256 of its bytes): a caption file that is
not there, or whose bytes changed since, is the user's (hand-written) and is never overwritten. Every file is
written under a temporary name, synced and renamed: a kill leaves the old file or the new one."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tasks.store.hashing import digest_bytes

MARKER = ".loraflow-captions.json"  # hidden: the dataset's walk skips dot files


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def written_by_loraflow(folder: Path) -> dict[str, str]:
    """The folder's record of the caption files loraflow wrote: {relative path: sha256}."""
    try:
        return json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def is_ours(record: dict[str, str], rel_caption: str, caption_file: str) -> bool:
    """A caption file loraflow wrote and nobody changed since."""
    digest = record.get(rel_caption)
    if digest is None:
        return False
    try:
        with open(caption_file, "rb") as f:
            return digest_bytes(f.read()) == digest
    except OSError:
        return False


def write_run_captions(run_dir: Path, captions: dict[str, str]) -> Path:
    """<run dir>/captions/<item name>.txt (the image's extension replaced) for each captioned image."""
    out = Path(run_dir) / "captions"
    for name, text in captions.items():
        path = out / (name.rsplit(".", 1)[0] + ".txt")
        data = (text + "\n").encode("utf-8")
        if not (path.is_file() and path.read_bytes() == data):
            atomic_write(path, data)
    return out


def write_beside(folder: Path, captions: dict[str, str], record: dict[str, str]) -> int:
    """caption.beside_images: each caption at `<folder>/<rel caption path>` (only where no hand-written file is),
    the record updated after the files. Returns the files written."""
    written = 0
    for rel, text in captions.items():
        path = Path(folder) / rel
        data = (text + "\n").encode("utf-8")
        if path.exists() and not is_ours(record, rel, str(path)):
            continue  # the user's own caption: never overwritten
        if not (path.is_file() and path.read_bytes() == data):
            atomic_write(path, data)
            written += 1
        record[rel] = digest_bytes(data)
    atomic_write(Path(folder) / MARKER, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    return written
