"""Which folders train: data.dir alone, its kohya `N_name/` folders, or data.subsets; each with its repeats,
caption extension and is_reg. Pure core (no prefect/hydra), like tasks.data.dataset.

Item names stay unique across folders: a subset's items are named `<label>/<path in its folder>`. The label
of a kohya folder is its name, so its items keep the names they had relative to data.dir; data.dir alone (and
a single entry of data.subsets) has no label, so its names, hence its keys, are those of a plain folder."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tasks.config_schema import DataConfig
from tasks.data.dataset import MEDIA_EXTS, DatasetCheck, DatasetError, Finding, is_dir, dataset_root, check_dataset

# kohya's DreamBooth folder name: `<repeats>_<name>`; at most 6 digits (int() of thousands of digits fails)
KOHYA_FOLDER = re.compile(r"^([1-9][0-9]{0,5})_(.+)$")


@dataclass(frozen=True)
class Subset:
    dir: Path
    label: str  # prefix of its items' names; "" keeps a plain folder's names
    repeats: int = 1
    caption_extension: str = ".txt"
    is_reg: bool = False

    def name(self, rel: str) -> str:
        return f"{self.label}/{rel}" if self.label else rel

    def report(self, images: int) -> dict:
        return {"folder": str(self.dir), "images": images, "repeats": self.repeats, "is_reg": self.is_reg}


def subset_errors(dc: DataConfig) -> list[str]:
    """Config errors of data.subsets (no file read)."""
    errors = []
    for i, s in enumerate(dc.subsets or []):
        if s.repeats < 1:
            errors.append(f"data.subsets[{i}].repeats={s.repeats}: must be at least 1 (an image's draws per epoch)")
        ext = s.caption_extension
        if ext is not None and (not ext.startswith(".") or len(ext) < 2):
            errors.append(f"data.subsets[{i}].caption_extension={ext!r}: must start with a dot, e.g. '.txt'")
    return errors


def resolve(dc: DataConfig) -> tuple[list[Subset], list[str]]:
    """The subsets to read and warnings (a mixed kohya layout). Raises DatasetError for a missing data.dir."""
    ext = dc.caption_extension
    if dc.subsets:
        labels = _labels([Path(s.dir) for s in dc.subsets])
        return [Subset(Path(s.dir), label, s.repeats, s.caption_extension or ext, s.is_reg)
                for s, label in zip(dc.subsets, labels)], []
    root = dataset_root(dc.dir)
    folders, outside, linked = _kohya_layout(root)
    if folders and not outside:  # linked folders are never followed; a plain folder's scan lists them, say it here
        return [Subset(path, path.name, repeats, ext) for path, repeats in folders], [
            f"data: linked folder {name} in data.dir is not followed (its images are not trained)" for name in linked]
    warnings = []
    if folders:  # kohya would train only the N_name folders; reading everything as before loses no image
        warnings.append(f"data: data.dir has kohya N_name folders ({', '.join(p.name for p, _ in folders)}) and "
                        f"images outside them ({', '.join(outside[:3])}{', ...' if len(outside) > 3 else ''}): read as "
                        "one folder, every image once per epoch; move every image into an N_name folder to get "
                        "the repeats")
    return [Subset(root, "", 1, ext)], warnings


def check(dc: DataConfig, subsets: list[Subset], memo_of=None, clips: bool = False,
          generated: dict[str, str] | None = None) -> list[tuple[Subset, DatasetCheck]]:
    """check_dataset of every subset, findings named like their items; every subset's problems in one error.
    `memo_of(folder)`: that folder's ImageMemo (tasks/data/image_memo.py), or None to decode every image;
    `generated`: the caption node's captions by image file."""
    checked, messages, problems = [], [], []
    for s in subsets:
        try:
            result = check_dataset(s.dir, dc.missing_caption, s.caption_extension, dc.bad_files,
                                   memo_of and memo_of(s.dir), clips, generated)
        except DatasetError as e:
            messages.append(str(e) if len(subsets) == 1 else f"subset {s.label or s.dir}: {e}")
            problems += e.problems
            continue
        findings = [Finding(s.name(f.file), f.reason, f.policy) for f in result.findings]
        checked.append((s, DatasetCheck(result.items, findings)))
    if messages:
        raise DatasetError("\n".join(messages), problems)
    return checked


def _labels(dirs: list[Path]) -> list[str]:
    if len(dirs) == 1:
        return [""]
    names = [d.name or "subset" for d in dirs]
    # two folders with the same name (a/img, b/img): numbered, so item names stay distinct
    return [n if names.count(n) == 1 else f"{n}.{i}" for i, n in enumerate(names)]


def _kohya_layout(root: Path) -> tuple[list[tuple[Path, int]], list[str], list[str]]:
    """(the `N_name/` folders directly under root with their repeats, the entries holding images outside them,
    the linked folders: not followed, as tasks.data.dataset does)."""
    folders, outside, linked = [], [], []
    with os.scandir(root) as it:  # its entries know "folder? link?" without a stat call (100,000 images)
        entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    for entry in entries:
        if entry.name.lower().endswith(MEDIA_EXTS) and not is_dir(entry):  # most entries: decided by the name
            outside.append(entry.name)
            continue
        match = KOHYA_FOLDER.match(entry.name)
        if not entry.is_symlink() and entry.is_dir():
            if match:
                folders.append((root / entry.name, int(match.group(1))))
            elif _has_images(Path(entry.path)):
                outside.append(entry.name + "/")
        elif entry.is_symlink() and os.path.isdir(entry.path):
            linked.append(entry.name + "/")
        elif entry.name.lower().endswith(MEDIA_EXTS):
            outside.append(entry.name)
    return folders, outside, linked


def _has_images(folder: Path) -> bool:
    for _, dirnames, files in os.walk(folder, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # hidden folders are not read (tasks.data.dataset)
        if any(f.lower().endswith(MEDIA_EXTS) and not f.startswith(".") for f in files):
            return True
    return False
