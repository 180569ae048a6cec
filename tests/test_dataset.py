"""Dataset scanning/validation; bad data is generated here, never committed."""

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.data.dataset import (DatasetError, ImageLoadError, Item, check_image, image_to_tensor,
                           load_image, scan_dataset, validate_dataset)

REPO = Path(__file__).resolve().parents[1]


def _png(path: Path, size=(32, 24), colour=(200, 30, 30), caption: str | None = "a thing"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
    return path


def _png_bytes(size=(32, 32)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_scan_recurses_sorted_skips_hidden_and_orphan_captions(tmp_path):
    _png(tmp_path / "b.png", caption="  second  ")
    _png(tmp_path / "a.jpg")
    _png(tmp_path / "sub" / "c.png")
    _png(tmp_path / ".hidden.png")
    _png(tmp_path / ".git" / "d.png")
    (tmp_path / "orphan.txt").write_text("no image")
    items, problems = scan_dataset(tmp_path)
    assert problems == []
    assert [i.name for i in items] == ["a.jpg", "b.png", "sub/c.png"]
    assert items[1].caption == "second" and items[1].caption_path == tmp_path / "b.txt"


def test_missing_caption_policies(tmp_path):
    _png(tmp_path / "cap.png")
    _png(tmp_path / "nocap.png", caption=None)
    items, problems = scan_dataset(tmp_path)
    assert [i.name for i in items] == ["cap.png"]
    assert [p.path for p in problems] == ["nocap.png"]
    with pytest.raises(DatasetError) as e:
        validate_dataset(tmp_path)
    assert "nocap.png" in str(e.value) and "data.missing_caption=empty" in str(e.value)
    items = validate_dataset(tmp_path, missing_caption="empty")
    assert [(i.name, i.caption, i.caption_path) for i in items][1] == ("nocap.png", "", None)


def test_options_are_checked(tmp_path):
    _png(tmp_path / "a.png", caption=None)
    (tmp_path / "a.caption").write_text("custom ext")
    assert scan_dataset(tmp_path, caption_extension=".caption")[0][0].caption == "custom ext"
    with pytest.raises(ValueError, match=r"data\.missing_caption.*error, empty"):
        scan_dataset(tmp_path, missing_caption="skip")
    with pytest.raises(DatasetError, match=r"data\.dir"):
        validate_dataset(tmp_path / "nope")
    with pytest.raises(DatasetError, match=r"data\.dir.*not a directory"):
        validate_dataset(tmp_path / "a.png")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match=r"no usable images in data\.dir"):
        validate_dataset(empty)


def test_validate_lists_every_problem(tmp_path):
    _png(tmp_path / "good.png")
    (tmp_path / "zero.png").write_bytes(b"")
    (tmp_path / "zero.txt").write_text("x")
    (tmp_path / "trunc.png").write_bytes(_png_bytes()[:200])
    (tmp_path / "trunc.txt").write_text("x")
    (tmp_path / "text.png").write_text("I am not an image")
    (tmp_path / "text.txt").write_text("x")
    _png(tmp_path / "nocap.png", caption=None)
    _png(tmp_path / "latin1.png")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    _png(tmp_path / "tiny.png", size=(4, 4))
    with pytest.raises(DatasetError) as e:
        validate_dataset(tmp_path)
    msg = str(e.value)
    bad = {"zero.png", "trunc.png", "text.png", "nocap.png", "latin1.png", "tiny.png"}
    assert {p.path for p in e.value.problems} == bad
    for name in bad:
        assert name in msg
    assert "good.png" not in msg
    assert "0 bytes" in msg and "truncated" in msg and "not a recognised image" in msg
    assert "UTF-8" in msg and "smaller than 16" in msg
    assert "data.missing_caption=empty" in msg and "add <stem>.txt" in msg
    assert len(msg.splitlines()) >= 1 + len(bad)


def test_symlink_outside_is_refused(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "outside"
    _png(data / "ok.png")
    _png(outside / "secret.png")
    (data / "link.png").symlink_to(outside / "secret.png")
    (data / "link.txt").write_text("x")
    (data / "inside.png").symlink_to(data / "ok.png")
    (data / "inside.txt").write_text("x")
    (data / "linkdir").symlink_to(outside, target_is_directory=True)
    items, problems = scan_dataset(data)
    assert [i.name for i in items] == ["inside.png", "ok.png"]
    assert [(p.path, "outside" in p.reason) for p in problems] == [("link.png", True), ("linkdir", True)]


def test_pure_core_imports_no_orchestration():
    code = "import sys, tasks.data.dataset, tasks.data.prompts; print(sorted(m for m in sys.modules if m in ('prefect', 'hydra')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_exif_rotation_is_applied(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    path = tmp_path / "rot.jpg"
    Image.new("RGB", (40, 20), "red").save(path, exif=exif)
    assert Image.open(path).size == (40, 20)
    assert load_image(path).size == (20, 40)


def test_palette_transparency_composited_on_white(tmp_path):
    img = Image.new("P", (20, 20), 0)
    img.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    img.paste(1, (0, 0, 10, 20))  # left half red, right half index 0 = transparent black
    img.save(tmp_path / "p.png", transparency=0)
    out = load_image(tmp_path / "p.png")
    assert out.mode == "RGB"
    assert out.getpixel((2, 2)) == (255, 0, 0) and out.getpixel((15, 2)) == (255, 255, 255)


def test_la_and_rgba_alpha_on_white(tmp_path):
    Image.new("LA", (20, 20), (0, 0)).save(tmp_path / "la.png")
    Image.new("RGBA", (20, 20), (0, 0, 255, 0)).save(tmp_path / "rgba.png")
    assert load_image(tmp_path / "la.png").getpixel((0, 0)) == (255, 255, 255)
    assert load_image(tmp_path / "rgba.png").getpixel((0, 0)) == (255, 255, 255)


def test_16bit_greyscale_is_scaled_not_clipped(tmp_path):
    arr = np.full((20, 30), 32896, np.uint16)  # mid grey in 16-bit (128 * 257)
    arr[:, :10] = 0
    Image.fromarray(arr).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    out = load_image(tmp_path / "g16.png")
    assert out.mode == "RGB" and out.size == (30, 20)
    assert out.getpixel((0, 0)) == (0, 0, 0) and out.getpixel((20, 0)) == (128, 128, 128)


def test_cmyk_jpeg_and_greyscale(tmp_path):
    Image.new("CMYK", (20, 20), (0, 255, 255, 0)).save(tmp_path / "c.jpg")
    r, g, b = load_image(tmp_path / "c.jpg").getpixel((10, 10))
    assert r > 200 and g < 60 and b < 60  # cyan=0, magenta+yellow full -> red
    Image.new("L", (20, 20), 77).save(tmp_path / "l.bmp")
    assert load_image(tmp_path / "l.bmp").getpixel((0, 0)) == (77, 77, 77)


def test_load_errors_have_clear_reasons(tmp_path, monkeypatch):
    (tmp_path / "zero.png").write_bytes(b"")
    (tmp_path / "trunc.png").write_bytes(_png_bytes()[:200])
    (tmp_path / "text.png").write_text("hello")
    with pytest.raises(ImageLoadError, match="0 bytes"):
        load_image(tmp_path / "zero.png")
    assert "truncated" in check_image(tmp_path / "trunc.png")
    assert "not a recognised image" in check_image(tmp_path / "text.png")
    assert "cannot read" in check_image(tmp_path / "missing.png")
    _png(tmp_path / "ok.png")
    assert check_image(tmp_path / "ok.png") is None
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    _png(tmp_path / "big.png", size=(12, 12))  # > MAX: Pillow only warns; we refuse
    _png(tmp_path / "huge.png", size=(30, 30))  # > 2*MAX: Pillow raises
    assert "decompression bomb" in check_image(tmp_path / "big.png")
    assert "decompression bomb" in check_image(tmp_path / "huge.png")


def test_image_to_tensor_cover_crop():
    img = Image.new("RGB", (100, 50), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 25, 50))  # left quarter blue gets cropped away
    t = image_to_tensor(img, 32, 32)
    assert t.shape == (3, 32, 32) and t.dtype == torch.float32
    assert t.min() >= -1 and t.max() <= 1
    assert torch.equal(t[:, :, 16], torch.tensor([1.0, -1.0, -1.0]).expand(32, 3).T)  # 255 -> 1, 0 -> -1: exact
    assert torch.equal(t, image_to_tensor(img, 32, 32))  # deterministic
    assert image_to_tensor(img, 48, 16).shape == (3, 16, 48)


def _run_demo_script(out: Path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_demo_data.py"), str(out)], check=True,
                   capture_output=True)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_demo_script_is_deterministic_and_matches_committed(tmp_path):
    a = _run_demo_script(tmp_path / "a" / "demo")
    b = _run_demo_script(tmp_path / "b" / "demo")
    assert a == b and len(a) == 24
    assert (tmp_path / "a" / "demo_prompts.txt").read_bytes() == (REPO / "data" / "demo_prompts.txt").read_bytes()
    committed = REPO / "data" / "demo"
    assert sorted(p.name for p in committed.iterdir()) == sorted(a)
    for name, data in a.items():
        if name.endswith(".txt"):
            assert (committed / name).read_bytes() == data
        else:  # compare pixels: PNG bytes can differ between zlib builds
            got = np.asarray(Image.open(committed / name))
            assert np.array_equal(got, np.asarray(Image.open(io.BytesIO(data))))
            assert got.shape == (96, 96, 3)
    items = validate_dataset(committed)
    assert len(items) == 12 and items[0] == Item("img_00.png", committed / "img_00.png",
                                                 committed / "img_00.txt", "a red circle on a blue background",
                                                 size=(96, 96))
