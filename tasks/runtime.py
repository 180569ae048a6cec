"""What besides a node's inputs changes the bytes it computes: the device type and the versions of the
libraries that compute them. Part of every item key, but only where they differ from the reference
runtime (the CPU and the versions pinned in constraints.txt), so the keys made there stay as they were."""
from __future__ import annotations

import functools
import importlib.metadata
import os
import sys

from tasks.lazy import lazy

torch = lazy("torch")


# The pins of constraints.txt (a test holds them equal) plus Pillow, which decodes and resizes the images.
REFERENCE = {"torch": "2.13.0", "diffusers": "0.42.1", "transformers": "5.23.0", "peft": "0.21.2",
             "accelerate": "1.15.0", "pillow": "13.0.0"}


# torch.cuda needs a GPU driver: NVIDIA's (/proc/driver/nvidia, /dev/nvidiactl), WSL's (/dev/dxg) or ROCm's
# (/dev/kfd). Without any, torch.cuda.is_available() is False and there is no need to import torch to ask.
_GPU_DRIVERS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def cuda_available() -> bool:
    """torch.cuda.is_available(); on Linux with no GPU driver, False without importing torch (1-2 s of a
    no-op run's start-up)."""
    if "torch" not in sys.modules and sys.platform.startswith("linux") and \
            not any(os.path.exists(p) for p in _GPU_DRIVERS):
        return False
    return torch.cuda.is_available()


@functools.cache
def versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name).split("+")[0] for name in REFERENCE}


def runtime() -> dict:
    """{} on the reference runtime; else {"device": "cuda"} and/or {"libs": {name: version}}."""
    out = {}
    if cuda_available():  # every node computes on CUDA when there is one
        out["device"] = "cuda"
    if versions() != REFERENCE:
        out["libs"] = versions()
    return out
