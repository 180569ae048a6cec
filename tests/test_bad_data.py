"""The bad-data corpus: every kind of broken or odd file, generated here (real files, no mocks).

Each file is either rejected (data.bad_files=error, the default: all listed, nothing runs), left out
(data.bad_files=skip), or trained after a stated conversion; report.json lists each under "dataset"."""
from __future__ import annotations

import io
import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import tasks.data.dataset as dataset
from tasks.data.dataset import DatasetError, check_dataset

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo"


def _noise(seed: int, size=(32, 32), channels=3) -> np.ndarray:
    shape = (size[1], size[0], channels) if channels > 1 else (size[1], size[0])
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def _raw_png(width: int, height: int, depth: int, colour_type: int, rows: bytes) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, depth, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows))
            + _chunk(b"IEND", b""))


def _encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _write(folder: Path, name: str, data: bytes | Image.Image, caption: str | bytes | None = "a thing", **kw):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, Image.Image):
        data.save(path, **kw)
    else:
        path.write_bytes(data)
    if caption is not None:
        cap = path.with_suffix(".txt")
        cap.write_bytes(caption if isinstance(caption, bytes) else caption.encode("utf-8"))


def make_corpus(folder: Path) -> None:
    """Good demo images plus one file (or pair) per bad-data case."""
    folder.mkdir(parents=True)
    for src, dst in (("img_00", "img_00"), ("img_01", "img_01"), ("img_02", "sub/img_02")):
        (folder / dst).parent.mkdir(parents=True, exist_ok=True)
        for ext in (".png", ".txt"):
            shutil.copyfile(DEMO / f"{src}{ext}", folder / f"{dst}{ext}")
    rgb = lambda seed: Image.fromarray(_noise(seed))  # noqa: E731  (distinct bytes: distinct latents)
    _write(folder, "my photo é.png", rgb(1), caption="un café ☕ with spaces")
    # unreadable
    _write(folder, "zero.png", b"")
    _write(folder, "truncated.png", _encoded(rgb(2), "PNG")[:300])
    _write(folder, "truncated.jpg", (lambda b: b[:len(b) // 2])(_encoded(rgb(3), "JPEG")))
    _write(folder, "text.png", b"this is a text file, not a picture\n")
    _write(folder, "bomb.png", _raw_png(20000, 20000, 8, 0, b"\x00" * 64))  # header says 400 Mpx
    _write(folder, "tiny.png", Image.fromarray(_noise(4, (4, 4))))  # smaller than one latent patch
    _write(folder, "latin1.png", rgb(5), caption="caf\xe9".encode("latin-1"))
    # converted
    _write(folder, "cmyk.jpg", Image.new("CMYK", (32, 32), (0, 255, 255, 0)))
    palette = Image.fromarray(_noise(6, channels=1) % 4, "L").convert("P")
    palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 756)
    _write(folder, "palette.png", palette, transparency=0)
    _write(folder, "grey16.png", Image.fromarray(_noise(7, channels=1).astype(np.uint16) * 257))
    rows16 = b"".join(b"\x00" + _noise(8, (32, 1), 6).tobytes() for _ in range(32))
    _write(folder, "rgb16.png", _raw_png(32, 32, 16, 2, rows16))
    _write(folder, "grey.jpg", Image.fromarray(_noise(9, channels=1), "L"))
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90° clockwise
    _write(folder, "rotated.jpg", Image.fromarray(_noise(10, (40, 20))), exif=exif)
    # captions
    _write(folder, "empty_caption.png", rgb(11), caption="")
    _write(folder, "no_caption.png", rgb(12), caption=None)
    _write(folder, "bom.png", rgb(13), caption="\ufeffa caption saved by notepad".encode("utf-8"))
    (folder / "orphan.txt").write_text("a caption without its image")
    _write(folder, "twin.png", rgb(14), caption="one caption, two images")
    _write(folder, "twin.jpg", rgb(15), caption=None)
    # links
    os.symlink("loop_b.png", folder / "loop_a.png")
    os.symlink("loop_a.png", folder / "loop_b.png")
    os.symlink("..", folder / "sub" / "up", target_is_directory=True)


GOOD = ["img_00.png", "img_01.png", "my photo é.png", "sub/img_02.png"]
# (file, words in its reason, its policy under data.bad_files=skip data.missing_caption=empty)
CASES = [
    ("zero.png", "0 bytes", "skipped"),
    ("truncated.png", "truncated", "skipped"),
    ("truncated.jpg", "truncated", "skipped"),
    ("text.png", "not a recognised image", "skipped"),
    ("bomb.png", "decompression bomb", "skipped"),
    ("tiny.png", "smaller than 16 px", "skipped"),
    ("latin1.png", "not valid UTF-8", "skipped"),
    ("loop_a.png", "symlink cycle", "skipped"),
    ("loop_b.png", "symlink cycle", "skipped"),
    ("cmyk.jpg", "CMYK", "converted to RGB"),
    ("palette.png", "palette image with transparency", "composited on white, converted to RGB"),
    ("grey16.png", "16-bit greyscale", "scaled to 8-bit, converted to RGB"),
    ("rgb16.png", "16-bit colour", "reduced to 8 bits per channel"),
    ("grey.jpg", "greyscale image", "converted to RGB"),
    ("rotated.jpg", "EXIF orientation 6", "orientation applied (turned upright)"),
    ("empty_caption.png", "is empty", "trained with an empty caption"),
    ("no_caption.png", "no caption file", "trained with an empty caption"),
    ("bom.png", "byte-order mark", "mark removed"),
    ("orphan.txt", "caption without an image", "ignored"),
    ("twin.png", "same stem as twin.jpg", "trained, with the shared caption"),
    ("twin.jpg", "same stem as twin.png", "trained, with the shared caption"),
    ("sub/up", "loops back to a parent folder", "not followed"),
]
SKIPPED = sorted(f for f, _, policy in CASES if policy == "skipped")
TRAINED = sorted(GOOD + [f for f, _, p in CASES if p not in ("skipped", "ignored", "not followed")])
# Rejected under the defaults (bad_files=error, missing_caption=error).
REJECTED = sorted(SKIPPED + ["empty_caption.png", "no_caption.png"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad") / "data"
    make_corpus(folder)
    return folder


@pytest.fixture(scope="module")
def skipped(corpus):
    return check_dataset(corpus, missing_caption="empty", bad_files="skip")


def test_defaults_reject_listing_every_bad_file_with_reason_and_ways_out(corpus):
    with pytest.raises(DatasetError) as e:
        check_dataset(corpus)
    msg = str(e.value)
    assert sorted({p.path for p in e.value.problems}) == REJECTED
    for file, reason, _ in CASES:
        if file in REJECTED:
            assert any(file in line and reason in line for line in msg.splitlines()), (file, reason)
    assert "data.missing_caption=empty" in msg and "data.bad_files=skip" in msg
    assert not any(g in msg for g in GOOD + ["cmyk.jpg", "twin.png"])


def test_skip_alone_still_rejects_missing_captions(corpus):
    with pytest.raises(DatasetError) as e:
        check_dataset(corpus, bad_files="skip")
    assert sorted(p.path for p in e.value.problems) == ["empty_caption.png", "no_caption.png"]
    msg = str(e.value)
    assert "data.missing_caption=empty" in msg and "left out by data.bad_files=skip (9)" in msg
    assert "or set data.bad_files=skip" not in msg  # it would not help here


@pytest.mark.parametrize("file,reason,policy", CASES, ids=[c[0] for c in CASES])
def test_each_case_has_its_reason_and_policy(skipped, file, reason, policy):
    found = [(f.reason, f.policy) for f in skipped.findings if f.file == file]
    assert any(reason in r and p == policy for r, p in found), found


def test_good_and_converted_files_train_and_nothing_else(skipped):
    assert [i.name for i in skipped.items] == TRAINED
    named = {f.file for f in skipped.findings}
    assert not named & set(GOOD)  # a clean file has nothing to report
    assert named == {c[0] for c in CASES}
    sizes = {i.name: i.size for i in skipped.items}
    assert sizes["rotated.jpg"] == (20, 40)  # orientation honoured: stored 40x20
    caps = {i.name: i.caption for i in skipped.items}
    assert caps["bom.png"] == "a caption saved by notepad" and caps["twin.jpg"] == caps["twin.png"] != ""
    assert caps["my photo é.png"] == "un café ☕ with spaces"


def test_each_image_is_decoded_once(corpus, monkeypatch):
    calls = []
    real = dataset.inspect_image
    monkeypatch.setattr(dataset, "inspect_image", lambda path: calls.append(path) or real(path))
    check_dataset(corpus, missing_caption="empty", bad_files="skip")
    assert len(calls) == len(set(calls)) == len(TRAINED) + len(SKIPPED) - 2  # loop links are never opened


def test_bad_files_value_is_checked(corpus):
    with pytest.raises(ValueError, match=r"data\.bad_files='maybe'.*error, skip"):
        check_dataset(corpus, bad_files="maybe")


def test_flow_trains_the_good_files_and_reports_the_rest(prefect_api, corpus, tmp_path):
    from flows.train import train_flow

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on a blue background\n")
    out = train_flow("train", [f"data.dir={corpus}", f"sample.prompts_file={prompts}",
                               f"store.root={tmp_path / 'store'}", f"hydra.run.dir={tmp_path / 'run'}",
                               "data.bad_files=skip", "data.missing_caption=empty", "train.max_steps=4",
                               "sample.steps=2"])
    report = json.loads(Path(out["report"]).read_text())
    assert report["nodes"]["cache_latents"]["computed"] == len(TRAINED)
    assert report["nodes"]["validate"]["computed"] == len(TRAINED)
    assert report["nodes"]["train"]["status"] == "ran" and Path(report["artifacts"]["lora"]).is_file()
    listed = {(d["file"], d["policy"]) for d in report["dataset"]}
    assert {(f, p) for f, _, p in CASES} <= listed
    assert any("left out by data.bad_files=skip" in w and "bomb.png" in w for w in report["warnings"])
