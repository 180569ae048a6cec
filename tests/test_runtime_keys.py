"""Device and library versions in the keys (issue 18, item 8): an artifact computed on CUDA, or under other
versions of the libraries that compute it, never shares a key with one from the reference runtime (the CPU,
the pinned versions), whose keys stay as they were."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from tasks import cache_latents, cache_text, runtime, sample, train
from tasks.config import compose, resolve_paths
from tasks.plan import Plan


PROMPTS = [{"line": 1, "prompt": "a", "negative": None, "width": None, "height": None, "steps": None, "guidance": None,
            "true_cfg": None, "seed": None}]


def _keys(tmp_path):
    from tasks.models.tiny.tiny_flux import build_tiny_flux

    model = tmp_path / "m"
    if not (model / "model_index.json").is_file():
        build_tiny_flux(model)
    plan = Plan(family="flux", model_dir=str(model), size=[64, 64], items=[], prompts=PROMPTS, warnings=[],
                ids={"vae": "v", "text": "t", "denoiser": "d", "scheduler": "s", "sample": "m"}, augmentation={},
                dataset=[], dataset_subsets=[])
    cfg = resolve_paths(compose("train", [])[0])
    text = {"prompt:1": "p", "empty": "e"}
    return {"latents": cache_latents.params(cfg, plan), "text": cache_text.params(cfg, plan),
            "train": train.inputs(cfg, plan, {}, {}), "sample": sample.item_keys(cfg, plan, "l", text)}


def test_reference_runtime_keys_unchanged_cuda_and_versions_enter(tmp_path, monkeypatch):
    assert runtime.runtime() == {}  # this machine: CPU, the pinned versions
    ref = _keys(tmp_path)
    assert not any("device" in k or "libs" in k for k in list(ref["latents"]) + list(ref["text"]) + list(ref["train"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = _keys(tmp_path)
    for node in ("latents", "text", "train"):
        assert cuda[node]["device"] == "cuda"
    assert cuda["sample"] != ref["sample"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime, "versions", lambda: {**runtime.REFERENCE, "diffusers": "0.99.0"})
    other = _keys(tmp_path)
    for node in ("latents", "text", "train"):
        assert other[node]["libs"]["diffusers"] == "0.99.0"
    assert other["sample"] != ref["sample"]


def test_reference_versions_are_the_pins():
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (Path(__file__).parents[1] / "constraints.txt").read_text(), re.M))
    pins = {k.lower(): v for k, v in pins.items()}
    for name, version in runtime.REFERENCE.items():
        if name in pins:
            assert pins[name] == version, name
