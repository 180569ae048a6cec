"""Video clips as data and as samples (issue 33, the data layer): decoded and written with PyAV (`av`, which
ships its own FFmpeg), never an ffmpeg subprocess.

- `inspect_clip` decodes a clip to its end (a truncated or corrupt file shows there, as `check_image` decodes
  an image fully) and says why it cannot be used, or its frame count, rate and size.
- `read_frames` takes `frames` frames at `fps` (resampled by timestamp: the frame shown at each instant
  start + k / fps, as a player would show it), RGB uint8 [F, H, W, 3]. Video VAEs (Wan, LTX) take 1 + 4k
  frames: `vae_frames` rounds a count down to that rule.
- `write_mp4` writes frames as H.264 (yuv420p, what every player and browser plays) under a temporary name,
  then renames it: a killed run never leaves a half-written video.
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

from tasks.lazy import lazy

np = lazy("numpy")  # a no-op run reads no frames (tasks/lazy.py)

CLIP_EXTENSIONS = (".mp4", ".webm", ".mov")


@dataclass(frozen=True)
class ClipInfo:
    frames: int
    fps: float
    width: int
    height: int
    span: float = 0.0  # seconds from the first frame's timestamp to the last's

    @property
    def seconds(self) -> float:
        return self.frames / self.fps

    def frames_at(self, fps: float | None) -> int:
        """How many frames `read_frames` gives at `fps` (None: the clip's own rate) from the start: one per
        1/fps while the instant is on screen (up to half a frame past the last timestamp)."""
        if not fps:
            return self.frames
        return int(math.floor((self.span + 0.5 / self.fps) * fps + 1e-9)) + 1

    def train_frames(self, frames: int, fps: float | None, step: int) -> int:
        """The frames a clip trains at: `frames` (data.frames), or fewer where the clip is shorter, on the
        VAE's 1 + step*k rule; a clip's frame count is its frame bucket."""
        return vae_frames(min(frames, self.frames_at(fps)), step)


@dataclass
class Video:
    """A video family's sample: RGB frames (PIL images) and the rate they play at (tasks/sample.py saves it as
    an mp4)."""
    frames: list
    fps: float


class ClipLoadError(Exception):
    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def is_clip(path) -> bool:
    return Path(path).suffix.lower() in CLIP_EXTENSIONS


def vae_frames(n: int, step: int = 4) -> int:
    """The largest count of the form 1 + step * k not above n (the Wan and LTX VAEs' rule), at least 1."""
    return 1 + max(0, (n - 1) // step) * step


def _decoded(path, data: bytes | None = None):
    """(stream's average rate, [(time in seconds, frame)]) of every frame, in presentation order; from `data`
    (the file's bytes, read once by the caller) where given."""
    import av

    try:
        with av.open(io.BytesIO(data) if data is not None else str(path)) as container:
            if not container.streams.video:
                raise ClipLoadError(path, "no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            out = []
            for frame in container.decode(stream):
                t = float(frame.time) if frame.time is not None else len(out) / (rate or 1)
                out.append((t, frame))
    except ClipLoadError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as e:  # corrupt, truncated, not a container
        raise ClipLoadError(path, f"cannot decode video ({type(e).__name__}: {e})") from e
    if not out:
        raise ClipLoadError(path, "no frame could be decoded")
    if rate <= 0:
        raise ClipLoadError(path, "no frame rate in the file")
    return rate, sorted(out, key=lambda tf: tf[0])


def inspect_clip(path) -> tuple[str | None, ClipInfo | None]:
    """(reason it cannot be used or None, its frames, rate and size) from one full decode."""
    try:
        rate, frames = _decoded(path)
    except ClipLoadError as e:
        return e.reason, None
    first = frames[0][1]
    return None, ClipInfo(len(frames), rate, first.width, first.height, frames[-1][0] - frames[0][0])


def read_clip(path, frames: int, fps: float | None = None) -> tuple[np.ndarray, str]:
    """read_frames, and the sha256 of the very bytes decoded (the file is read once), as images.read_image."""
    from tasks.store.hashing import digest_bytes

    data = Path(path).read_bytes()
    return read_frames(path, frames, fps, data=data), digest_bytes(data)


def read_frames(path, frames: int, fps: float | None = None, start: float = 0.0, data: bytes | None = None) -> np.ndarray:
    """`frames` RGB frames [F, H, W, 3] uint8 from `start` seconds at `fps` (None: the clip's own rate); a
    clip too short for them gives what it has (the caller rounds to the VAE's rule)."""
    rate, decoded = _decoded(path, data)
    fps = fps or rate
    times = [t for t, _ in decoded]
    t0 = times[0]
    picked, i = [], 0
    for k in range(frames):
        at = t0 + start + k / fps
        if at > times[-1] + 0.5 / rate:  # past the last frame's display time
            break
        while i + 1 < len(times) and times[i + 1] <= at + 1e-6:  # the frame on screen at `at`
            i += 1
        picked.append(decoded[i][1])
    if not picked:
        raise ClipLoadError(path, f"starts after its end ({start:.2f} s of {times[-1] - t0:.2f} s)")
    return np.stack([f.to_ndarray(format="rgb24") for f in picked])


def write_mp4(frames, path, fps: float) -> Path:
    """RGB frames ([F, H, W, 3] uint8, or PIL images) as an H.264 mp4, written atomically."""
    import av

    arr = np.stack([np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, dtype=np.uint8) for f in frames])
    h, w = arr.shape[1:3]
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.mp4")
    try:
        with av.open(str(tmp), mode="w") as container:
            stream = container.add_stream("libx264", rate=round(fps))
            stream.width, stream.height = w + w % 2, h + h % 2  # yuv420p needs even sides
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "18"}
            for a in arr:
                if a.shape[:2] != (stream.height, stream.width):
                    a = np.pad(a, ((0, stream.height - h), (0, stream.width - w), (0, 0)), mode="edge")
                # converted here, not by the encoder: fewer outcomes for the same frames (the bytes still vary
                # with the process's state: docs/learning.md)
                frame = av.VideoFrame.from_ndarray(a, format="rgb24").reformat(format="yuv420p")
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
