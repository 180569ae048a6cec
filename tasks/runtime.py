"""What besides a node's inputs changes the bytes it computes: the device type and the versions of the
libraries that compute them. Part of every item key, but only where they differ from the reference
runtime (the CPU and the versions pinned in constraints.txt), so the keys made there stay as they were."""
from __future__ import annotations

import functools
import importlib.metadata

import torch

# The pins of constraints.txt (a test holds them equal) plus Pillow, which decodes and resizes the images.
REFERENCE = {"torch": "2.13.0", "diffusers": "0.42.1", "transformers": "5.23.0", "peft": "0.21.2",
             "accelerate": "1.15.0", "pillow": "13.0.0"}


@functools.cache
def versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name).split("+")[0] for name in REFERENCE}


def runtime() -> dict:
    """{} on the reference runtime; else {"device": "cuda"} and/or {"libs": {name: version}}."""
    out = {}
    if torch.cuda.is_available():  # every node computes on CUDA when there is one
        out["device"] = "cuda"
    if versions() != REFERENCE:
        out["libs"] = versions()
    return out
