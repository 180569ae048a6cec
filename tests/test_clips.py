"""Issue 33, the data layer (tasks/data/clips.py): real clips written and read with PyAV.

Frames are solid colours that encode their index (red = 8 x index), so a decoded frame says which source frame
it is despite the codec's loss: H.264 at crf 18 keeps a flat colour within a few levels (the tolerance, 3,
rests on that, measured 0-1 here)."""
from __future__ import annotations

import numpy as np
import pytest

from tasks.data.clips import inspect_clip, is_clip, read_frames, vae_frames, write_mp4

TOL = 3  # levels of 255: an H.264 flat frame's error at crf 18


def _frames(n, h=32, w=48):
    return np.stack([np.full((h, w, 3), (8 * i, 100, 200 - 8 * i), dtype=np.uint8) for i in range(n)])


def _index(frame) -> int:
    return round(float(frame[..., 0].mean()) / 8)


def test_vae_frame_rule():
    assert [vae_frames(n) for n in (1, 2, 4, 5, 8, 9, 81, 83)] == [1, 1, 1, 5, 5, 9, 81, 81]


def test_write_then_read_back(tmp_path):
    clip = write_mp4(_frames(12), tmp_path / "a.mp4", fps=12)
    assert clip.is_file() and not list(tmp_path.glob(".*tmp*"))  # renamed into place, nothing half-written
    reason, info = inspect_clip(clip)
    assert reason is None and (info.frames, info.fps, info.width, info.height) == (12, 12.0, 48, 32)
    got = read_frames(clip, 9)
    assert got.shape == (9, 32, 48, 3) and [_index(f) for f in got] == list(range(9))
    assert np.abs(got.astype(int) - _frames(9).astype(int)).max() <= TOL


def test_fps_resampling_and_start(tmp_path):
    clip = write_mp4(_frames(24), tmp_path / "b.mp4", fps=24)
    # at 8 fps every third source frame; from 0.5 s the frames from index 12 on
    assert [_index(f) for f in read_frames(clip, 5, fps=8)] == [0, 3, 6, 9, 12]
    assert [_index(f) for f in read_frames(clip, 3, fps=8, start=0.5)] == [12, 15, 18]
    # upsampled to 48 fps each source frame shows twice
    assert [_index(f) for f in read_frames(clip, 6, fps=48)] == [0, 0, 1, 1, 2, 2]
    assert len(read_frames(clip, 50)) == 24  # a clip shorter than asked gives what it has


def test_odd_sizes_are_padded_for_yuv420(tmp_path):
    clip = write_mp4(_frames(3, h=31, w=45), tmp_path / "c.mp4", fps=10)
    _, info = inspect_clip(clip)
    assert (info.width, info.height) == (46, 32)


def test_broken_clips_say_why(tmp_path):
    good = write_mp4(_frames(30), tmp_path / "d.mp4", fps=10)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    junk = tmp_path / "junk.webm"
    junk.write_bytes(b"not a video at all")
    for bad in (cut, junk):
        reason, info = inspect_clip(bad)
        assert info is None and reason, bad
    assert is_clip(junk) and is_clip(tmp_path / "x.MOV") and not is_clip(tmp_path / "x.png")


@pytest.mark.parametrize("codec,suffix", [("libvpx-vp9", ".webm"), ("libx264", ".mov")])
def test_other_containers_read(tmp_path, codec, suffix):
    import av

    path = tmp_path / f"e{suffix}"
    with av.open(str(path), mode="w") as c:
        s = c.add_stream(codec, rate=10)
        s.width, s.height, s.pix_fmt = 48, 32, "yuv420p"
        for a in _frames(5):
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    reason, info = inspect_clip(path)
    assert reason is None and info.frames == 5
    assert [_index(f) for f in read_frames(path, 5)] == [0, 1, 2, 3, 4]

