"""Which images the caption node captions (data.captions): `file` none (today's behaviour: every caption is a
file); `auto` and `regenerate` each image without a hand-written caption file, that is without one, or with one
loraflow wrote itself (caption.beside_images) and nobody edited since. `regenerate` also recomputes captions the
store holds. A hand-written caption always wins. Images only: a video family's clips keep their caption files."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tasks.captioning.files import is_ours, written_by_loraflow
from tasks.config_schema import DataConfig
from tasks.data import subsets
from tasks.data.dataset import scan_dataset

MODES = ("file", "auto", "regenerate")


@dataclass(frozen=True)
class Wanted:
    """An image to caption."""
    name: str  # its item name (a subset's label first), as the plan names it
    image: str  # the file
    folder: str  # its subset's folder
    caption_rel: str  # its caption file's path relative to the folder (<stem><ext>), where beside_images writes


def wanted(dc: DataConfig) -> tuple[list[Wanted], int]:
    """(the images to caption, the number of hand-written captions kept) in item order."""
    if dc.captions == "file":
        return [], 0
    chosen, _ = subsets.resolve(dc)
    out, kept = [], 0
    for s in chosen:
        items, _ = scan_dataset(s.dir, "empty", s.caption_extension)  # unusable files: validate's to report
        record = written_by_loraflow(s.dir)
        for it in items:
            rel = it.name.rsplit(".", 1)[0] + s.caption_extension
            if it.caption_file is None or is_ours(record, rel, it.caption_file):
                out.append(Wanted(s.name(it.name), os.path.abspath(it.image_file), str(Path(s.dir)), rel))
            else:
                kept += 1
    return out, kept
