"""Scan and validate a kohya-style image folder (image + same-stem caption file).

Pure core: no prefect/hydra. Every problem is collected before failing, so a user
fixes a broken dataset in one pass instead of one error per run.
"""

from __future__ import annotations

import codecs
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# Decoding lives in tasks.data.images; re-exported here for callers of the dataset API.
from tasks.data.images import (ImageLoadError, Note, check_image, decode_image, image_to_tensor,  # noqa: F401
                          inspect_image, load_image)
from tasks.data.clips import CLIP_EXTENSIONS, inspect_clip, is_clip

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MEDIA_EXTS = IMAGE_EXTS + CLIP_EXTENSIONS  # what a walk lists: clips train in video families, else are noted
MISSING_CAPTION_POLICIES = ("error", "empty")
BAD_FILE_POLICIES = ("error", "skip")
MIN_IMAGE_SIDE = 16
# Policies a finding can name besides the conversions tasks.data.images reports.
SKIPPED = "skipped"
SHARED_CAPTION = "trained, with the shared caption"
EMPTY_CAPTION = "trained with an empty caption"


class DatasetError(Exception):
    """The dataset cannot be used; the message lists every problem and the fix."""

    def __init__(self, message: str, problems: list[Problem] | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


@dataclass(frozen=True)
class Problem:
    path: str  # relative to data_dir, posix
    reason: str
    kind: str = "other"  # picks the fix hint: missing_caption | caption | image | small | symlink


@dataclass(frozen=True)
class Item:
    name: str  # image path relative to data_dir, posix
    image_file: str  # paths as strings: pathlib would cost 2 s of a no-op over 100,000 images
    caption_file: str | None
    caption: str
    size: tuple[int, int] | None = None  # (width, height) after EXIF orientation, once decoded
    digest: str | None = None  # sha256 of the image's bytes, when the check read them (tasks/data/image_memo.py)
    clip: tuple[int, float, float] | None = None  # a video clip's (frames, fps, span in seconds); None: an image

    def __post_init__(self):  # Paths are accepted, kept as strings (so items compare equal either way)
        if not isinstance(self.image_file, str):
            object.__setattr__(self, "image_file", os.fspath(self.image_file))
        if self.caption_file is not None and not isinstance(self.caption_file, str):
            object.__setattr__(self, "caption_file", os.fspath(self.caption_file))

    @property
    def image_path(self) -> Path:
        return Path(self.image_file)

    @property
    def caption_path(self) -> Path | None:
        return None if self.caption_file is None else Path(self.caption_file)


@dataclass(frozen=True)
class Finding:
    """A file trained after a fix, or left out: what was wrong and the policy applied (plan/report JSON)."""
    file: str  # relative to data_dir, posix
    reason: str
    policy: str


@dataclass
class DatasetCheck:
    items: list[Item]  # what trains, sorted by name
    findings: list[Finding]  # sorted by file


def _check_options(missing_caption: str, caption_extension: str, bad_files: str = "error") -> None:
    if missing_caption not in MISSING_CAPTION_POLICIES:
        raise ValueError(f"data.missing_caption={missing_caption!r} is invalid; "
                         f"allowed values: {', '.join(MISSING_CAPTION_POLICIES)}")
    if bad_files not in BAD_FILE_POLICIES:
        raise ValueError(f"data.bad_files={bad_files!r} is invalid; allowed values: {', '.join(BAD_FILE_POLICIES)}")
    if not caption_extension.startswith(".") or len(caption_extension) < 2:
        raise ValueError(f"data.caption_extension={caption_extension!r} is invalid; "
                         "it must start with a dot, e.g. '.txt'")


def dataset_root(data_dir) -> Path:
    root = Path(data_dir)
    if not root.exists():
        raise DatasetError(f"data.dir={str(root)!r} does not exist; point data.dir at a folder of images")
    if not root.is_dir():
        raise DatasetError(f"data.dir={str(root)!r} is not a directory; point data.dir at a folder of images")
    return root


def is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a looping link: not a folder (as os.walk and os.path.isdir answer)
        return False


class _File(NamedTuple):
    path: str
    name: str  # relative to the data root, posix
    link: bool  # a symlink (checked before use)


def _walk(root: Path, real_root: Path, ext: str, problems: list[Problem], notes: list[Finding]):
    """(image files, caption files) under root as _File, deterministic. Linked folders are never descended.
    os.scandir's entries answer "folder? link?" without a stat call: a 100,000-image folder is walked in
    well under a second."""
    images, captions = [], []

    def visit(folder: str, prefix: str) -> None:
        try:
            with os.scandir(folder) as it:
                entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
        except OSError:  # an unreadable folder is skipped, as os.walk skips it
            return
        subfolders = []
        for e in entries:
            link = e.is_symlink()
            if is_dir(e):  # follows links: a linked folder is reported, never descended
                if link:
                    _linked_dir(Path(e.path), root, real_root, problems, notes)
                else:
                    subfolders.append(e)
            elif e.name.lower().endswith(MEDIA_EXTS):  # a looping or broken link is listed here too
                images.append(_File(e.path, prefix + e.name, link))
            elif e.name.endswith(ext):
                captions.append(_File(e.path, prefix + e.name, link))
        for e in subfolders:
            visit(e.path, f"{prefix}{e.name}/")

    visit(str(root), "")
    return images, captions


def _linked_dir(link: Path, root: Path, real_root: Path, problems: list[Problem], notes: list[Finding]) -> None:
    name, why = _rel(link, root), _refused(link, real_root)
    if why:
        problems.append(Problem(name, f"symlinked folder {why}", "symlink"))
    elif link.parent.resolve().is_relative_to(link.resolve()):
        notes.append(Finding(name, "symlinked folder loops back to a parent folder", "not followed"))
    else:
        notes.append(Finding(name, "symlinked folder inside data.dir", "not followed (its images are not trained)"))


def _refused(path: Path, real_root: Path) -> str | None:
    """Why a (symlinked) path may not be used, or None."""
    try:
        target = path.resolve()
    except (RuntimeError, OSError):  # 3.11 raises RuntimeError on a symlink loop, later versions OSError
        return "loops (a symlink cycle that never reaches a file)"
    return None if target.is_relative_to(real_root) else "points outside data.dir (refused)"


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _caption(img: str, name: str, real_root: Path, policy: str, ext: str, listed: _File | None):
    """(caption text, caption file or None, problem or None, notes) for one image. `listed`: the caption file
    the walk found next to it, or None."""
    cap = listed.path if listed else os.path.splitext(img)[0] + ext
    cap_name = os.path.basename(cap)
    why = _refused(Path(cap), real_root) if listed and listed.link else None
    if why:
        return "", None, Problem(name, f"caption {cap_name} is a symlink that {why}", "symlink"), []
    if not listed or (listed.link and not os.path.isfile(cap)):
        reason = f"no caption file {cap_name}"
        if policy == "error":
            return "", None, Problem(name, reason, "missing_caption"), []
        return "", None, None, [Finding(name, reason, EMPTY_CAPTION)]
    try:
        with open(cap, "rb") as f:
            raw = f.read()
        # utf-8-sig: a BOM written by Windows editors is valid and must not end up in the caption.
        text = raw.decode("utf-8-sig").strip()
    except UnicodeDecodeError as e:
        return "", cap, Problem(name, f"caption {cap_name} is not valid UTF-8 (byte {e.start})", "caption"), []
    except OSError as e:
        return "", cap, Problem(name, f"caption {cap_name} cannot be read ({e.strerror or e})", "caption"), []
    notes = []
    if raw.startswith(codecs.BOM_UTF8):
        notes.append(Finding(name, f"caption {cap_name} starts with a UTF-8 byte-order mark", "mark removed"))
    if not text:
        if policy == "error":
            return "", cap, Problem(name, f"caption file {cap_name} is empty", "missing_caption"), []
        notes.append(Finding(name, f"caption file {cap_name} is empty", EMPTY_CAPTION))
    return text, cap, None, notes


def _generated(text: str, name: str, policy: str):
    """_caption's answer for a caption the caption node made: an empty one is a missing caption."""
    if text:
        return text, None, None, []
    reason = "the caption model returned an empty caption (caption.model, caption.prompt)"
    if policy == "error":
        return "", None, Problem(name, reason, "missing_caption"), []
    return "", None, None, [Finding(name, reason, EMPTY_CAPTION)]


NOT_A_VIDEO_FAMILY = "video clip: this model family trains images (a video family trains clips, e.g. model=tiny_wan)"


def _scan(data_dir, missing_caption: str, caption_extension: str, bad_files: str = "error", clips: bool = False,
          generated: dict[str, str] | None = None):
    """Candidates (item, its problems, its notes) plus dataset-level problems and notes. `clips`: video clips
    are items (a video family); else each is noted and left out. `generated`: {image file (absolute): caption}
    from the caption node, read instead of the image's caption file."""
    _check_options(missing_caption, caption_extension, bad_files)
    root = dataset_root(data_dir)
    real_root = root.resolve()
    problems: list[Problem] = []
    notes: list[Finding] = []
    candidates: list[tuple[Item, list[Problem], list[Finding]]] = []
    images, captions = _walk(root, real_root, caption_extension, problems, notes)
    stems: dict[str, list[_File]] = {}  # "folder/stem" -> its images
    for img in images:
        stems.setdefault(img.name.rsplit(".", 1)[0], []).append(img)
    caption_files = {cap.name: cap for cap in captions}
    notes += [Finding(cap.name, "caption without an image", "ignored")
              for cap in captions if cap.name[:-len(caption_extension)] not in stems]
    for img in images:
        name, stem = img.name, img.name.rsplit(".", 1)[0]
        if not clips and is_clip(name):
            notes.append(Finding(name, NOT_A_VIDEO_FAMILY, "ignored"))
            continue
        why = _refused(Path(img.path), real_root) if img.link else None
        if why:
            problems.append(Problem(name, f"symlink {why}", "symlink"))
            continue
        if generated and os.path.abspath(img.path) in generated:
            caption, cap_path, problem, mine = _generated(generated[os.path.abspath(img.path)], name, missing_caption)
        else:
            caption, cap_path, problem, mine = _caption(img.path, name, real_root, missing_caption, caption_extension,
                                                        caption_files.get(stem + caption_extension))
        twins = [os.path.basename(p.path) for p in stems[stem] if p is not img]
        if twins:  # kohya trains both; so do we, but say so (often one picture exported twice)
            mine.append(Finding(name, f"same stem as {', '.join(twins)}: one caption file "
                                      f"{os.path.basename(stem)}{caption_extension} for both", SHARED_CAPTION))
        candidates.append((Item(name, img.path, cap_path, caption), [problem] if problem else [], mine))
    return root, candidates, problems, notes


def scan_dataset(data_dir, missing_caption: str = "error",
                 caption_extension: str = ".txt") -> tuple[list[Item], list[Problem]]:
    """Find images and their captions without decoding pixels (cheap)."""
    _, candidates, problems, _ = _scan(data_dir, missing_caption, caption_extension)
    items = [item for item, mine, _ in candidates if not mine]
    problems += [p for _, mine, _ in candidates for p in mine]
    return sorted(items, key=lambda i: i.name), sorted(problems, key=lambda p: p.path)


_HINTS = {
    "missing_caption": "missing captions: set data.missing_caption=empty to train such images "
                       "with an empty caption, or add <stem>{ext} next to each image, or set data.captions=auto to caption "
                       "them with a vision-language model (caption.model) (data.bad_files=skip "
                       "does not leave them out: data.missing_caption alone decides)",
    "caption": "caption files: re-save them as UTF-8 text",
    "image": "unreadable images: re-export them (PNG/JPEG/WebP/BMP) or remove them",
    "small": f"tiny images: use images at least {MIN_IMAGE_SIDE} px on each side or remove them",
    "symlink": "symlinks: copy the files into data.dir instead of linking outside it; remove links that loop",
}


def _message(root: Path, errors: list[Problem], skipped: list[Problem], ext: str, bad_files: str,
             missing_caption: str) -> str:
    lines = [f"dataset data.dir={str(root)!r} has {len(errors)} problem(s) "
             f"(data.bad_files={bad_files}, data.missing_caption={missing_caption}):"]
    lines += [f"  {p.path}: {p.reason}" for p in errors]
    if skipped:
        lines.append(f"left out by data.bad_files=skip ({len(skipped)}):")
        lines += [f"  {p.path}: {p.reason}" for p in skipped]
    kinds = {p.kind for p in errors}
    lines.append("to fix:")
    lines += [f"  - {_HINTS[k].format(ext=ext)}" for k in _HINTS if k in kinds]
    if kinds - {"missing_caption"}:
        lines.append("  - or set data.bad_files=skip to leave the unusable files out and train the rest "
                     "(each is listed with its reason under 'dataset' in report.json)")
    return "\n".join(lines)


def inspect_media(path) -> tuple[str | None, tuple[int, int] | None, list, tuple | None]:
    """(reason it cannot be used or None, size, conversion notes, a clip's (frames, fps, span) or None)."""
    if is_clip(path):
        reason, info = inspect_clip(path)
        return (reason, None, [], None) if reason else (None, (info.width, info.height), [], (info.frames, info.fps, info.span))
    return (*inspect_image(path), None)


def check_dataset(data_dir, missing_caption: str = "error", caption_extension: str = ".txt",
                  bad_files: str = "error", memo=None, clips: bool = False,
                  generated: dict[str, str] | None = None) -> DatasetCheck:
    """Scan + decode every image once: the items that train, and a finding for every file trained after a
    fix or left out. Raises DatasetError listing every problem no policy covers. `memo` (an ImageMemo):
    images unchanged since an earlier check are not decoded again, and items carry their bytes' digest.
    `clips`: video clips (.mp4, .webm, .mov) are items too, each decoded to its end once (a video family).
    `generated`: the caption node's captions by image file (absolute), read instead of caption files."""
    root, candidates, problems, findings = _scan(data_dir, missing_caption, caption_extension, bad_files, clips,
                                                 generated)
    if memo is not None:
        memo.keep_only({item.name for item, _, _ in candidates})
    skip = bad_files == "skip"
    errors, skipped = ([], problems) if skip else (problems, [])
    items = []
    for item, mine, notes in candidates:
        if memo is None:
            (reason, size, converted, clip), digest = inspect_media(item.image_path), None
        else:  # a file seen unchanged before is not decoded again (tasks/data/image_memo.py)
            reason, size, converted, digest, clip = memo.facts(item.image_file, item.name)
        if reason:
            mine.append(Problem(item.name, reason, "image"))
        elif min(size) < MIN_IMAGE_SIDE:
            mine.append(Problem(item.name, f"image is {size[0]}x{size[1]}, smaller than "
                                           f"{MIN_IMAGE_SIDE} px on a side", "small"))
        if not mine:
            items.append(Item(item.name, item.image_file, item.caption_file, item.caption, tuple(size), digest,
                              clip and tuple(clip)))
            findings += notes + [Finding(item.name, why, policy) for why, policy in converted]
        elif skip and any(p.kind != "missing_caption" for p in mine):
            skipped += mine  # unusable anyway: a missing caption of a skipped file does not matter
        else:
            errors += mine
    errors.sort(key=lambda p: p.path)
    skipped.sort(key=lambda p: p.path)
    if errors:
        raise DatasetError(_message(root, errors, skipped, caption_extension, bad_files, missing_caption), errors)
    findings += [Finding(p.path, p.reason, SKIPPED) for p in skipped]
    if not items:
        left_out = f"; all {len(skipped)} file(s) found were left out by data.bad_files=skip" if skipped else ""
        raise DatasetError(f"no usable images in data.dir={str(root)!r} (looked for "
                           f"{', '.join(MEDIA_EXTS if clips else IMAGE_EXTS)}, "
                           f"recursively{left_out}); point data.dir at your image folder", skipped)
    return DatasetCheck(sorted(items, key=lambda i: i.name), sorted(findings, key=lambda f: (f.file, f.reason)))


def validate_dataset(data_dir, missing_caption: str = "error", caption_extension: str = ".txt",
                     bad_files: str = "error") -> list[Item]:
    """Scan + decode every image; raise DatasetError listing every problem."""
    return check_dataset(data_dir, missing_caption, caption_extension, bad_files).items
