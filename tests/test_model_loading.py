"""Real checkpoints: a transformer-only single file (flux1-dev.safetensors style) goes through diffusers'
from_single_file once, into the store; pickles and missing configs are refused with the fix."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.config import ConfigError
from tasks.models import resolve_model
from tasks.store import Store

MODEL = {"name": "x", "seed": 0, "arch": {}, "dtype": "float32", "max_sequence_length": 32, "config": None}


def _finetuned_single_file(base: Path, out: Path) -> dict:
    """The base transformer's weights, one tensor changed (so we can tell whose weights were loaded)."""
    sd = load_file(base / "transformer" / "diffusion_pytorch_model.safetensors")
    name = sorted(sd)[0]
    sd[name] = sd[name] + 0.5
    save_file(sd, str(out))
    return sd


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_transformer_single_file_is_converted_once(family, tmp_path, monkeypatch):
    store = Store(tmp_path / "store")
    base = resolve_model({**MODEL, "family": family, "path": None}, store)
    file = tmp_path / "my_finetune.safetensors"
    expected = _finetuned_single_file(base, file)

    folder = resolve_model({**MODEL, "family": family, "path": str(file), "config": str(base)}, store)
    assert folder != base and (folder / "model_index.json").is_file()
    got = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert load_file(folder / "vae" / "diffusion_pytorch_model.safetensors").keys()  # the rest from model.config

    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    def no_second_conversion(*a, **k):
        raise AssertionError("converted twice")

    for cls in (FluxTransformer2DModel, SD3Transformer2DModel):
        monkeypatch.setattr(cls, "from_single_file", no_second_conversion)
    assert resolve_model({**MODEL, "family": family, "path": str(file), "config": str(base)}, store) == folder


def test_single_file_through_the_dag(baseline, tmp_path):
    base = Path(baseline.first_report["artifacts"]["base_model"])
    file = tmp_path / "flux_finetune.safetensors"
    _finetuned_single_file(base, file)
    ws = baseline.copy_to(tmp_path / "ws")
    report = ws.run(f"model.path={file}", f"model.config={base}")
    n = report["nodes"]
    # Only the denoiser differs from the baseline's model: latents and text are reused, training re-runs.
    assert (n["cache_latents"]["computed"], n["cache_text"]["computed"], n["train"]["status"]) == (0, 0, "ran")
    assert report["artifacts"]["base_model"] != str(base)


def test_pickles_and_missing_config_are_refused(tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match=r"only \.safetensors"):
        resolve_model({**MODEL, "family": "sd15", "path": str(ckpt)}, Store(tmp_path / "s"))
    st = tmp_path / "model.safetensors"
    save_file({"x": torch.zeros(1)}, str(st))
    with pytest.raises(ConfigError, match="model.config="):
        resolve_model({**MODEL, "family": "sd15", "path": str(st)}, Store(tmp_path / "s"))
