"""What validate learned from each image file (its bytes' sha256, its size, conversions, or why it cannot be
used), remembered by the file's size, mtime and inode: a re-run decodes and digests only new or changed
files (`dvc status`'s trade-off, as tasks/store/filedigests.py makes it for model weights).

A file modified within the memo's own clock tick would keep its mtime (git's "racy" entries), so a file
changed in the last two seconds is never remembered; it is read again next run. One JSON file per image
folder, `<store>/index/images/<folder digest>.json`, with a digest of its content: a torn or altered memo
is ignored (every image is read again). `store.rehash=true` ignores it too."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from tasks.store.hashing import digest_bytes, key_of, sealed, unseal
from tasks.data.clips import inspect_clip, is_clip
from tasks.data.images import ImageLoadError, decode_image

log = logging.getLogger("loraflow")
RACY_NS = 2_000_000_000


class ImageMemo:
    def __init__(self, store_root: Path, folder: Path, use_stored: bool = True):
        self.path = Path(store_root) / "index" / "images" / f"{key_of({'folder': str(folder.resolve())})[:32]}.json"
        self._entries = self._read() if use_stored else {}
        self._new: dict[str, list] = {}
        self._forgot = False
        self.decoded = 0  # images read and decoded in this run (the rest came from the memo)

    def _read(self) -> dict:
        try:
            return unseal(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError) as e:
            log.warning("image memo %s is unreadable (%s): every image is read again", self.path, e)
            return {}

    def facts(self, path: Path, name: str) -> tuple[str | None, tuple[int, int] | None, list, str | None, list | None]:
        """(reason it cannot be used or None, size, conversion notes, sha256 of its bytes, a video clip's
        (frames, fps, span) or None) of one image or clip."""
        st = os.stat(path)
        sig = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self._entries.get(name)
        if hit is not None and hit[0] == sig:
            _, reason, size, notes, digest, *clip = hit  # entries written before clips have no sixth field
            return reason, size and tuple(size), [tuple(n) for n in notes], digest, clip[0] if clip else None
        self.decoded += 1
        if is_clip(name):
            return self._clip(path, name, st, sig)
        try:
            try:
                data = Path(path).read_bytes()
            except OSError:  # unreadable: decode_image says why, as it always has
                data = None
            digest = data is not None and digest_bytes(data) or None
            img, notes = decode_image(path, data)
            reason, size = None, list(img.size)
        except ImageLoadError as e:
            reason, size, notes, digest = e.reason, None, [], None
        if time.time_ns() - st.st_mtime_ns > RACY_NS:
            self._new[name] = [sig, reason, size, [list(n) for n in notes], digest]
        return reason, size and tuple(size), notes, digest, None

    def _clip(self, path, name: str, st, sig):
        """A clip decoded to its end once (tasks/data/clips.py), remembered like an image."""
        from tasks.store.hashing import digest_file

        reason, info = inspect_clip(path)
        digest = None if reason else digest_file(path)
        size, clip = (None, None) if reason else ([info.width, info.height], [info.frames, info.fps, info.span])
        if time.time_ns() - st.st_mtime_ns > RACY_NS:
            self._new[name] = [sig, reason, size, [], digest, clip]
        return reason, size and tuple(size), [], digest, clip

    def keep_only(self, names: set[str]) -> None:
        """Forget images no longer in the folder, so the memo does not grow with every file ever seen."""
        if set(self._entries) - names:
            self._entries = {k: v for k, v in self._entries.items() if k in names}
            self._forgot = True

    def save(self, write) -> None:
        """`write(path, bytes)` replaces a file atomically; only when something was learned or forgotten."""
        if not (self._new or self._forgot):
            return
        entries = {**self._entries, **self._new}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write(self.path, sealed(entries))
        self._entries, self._new, self._forgot = entries, {}, False
