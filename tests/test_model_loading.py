"""Real checkpoints: a transformer-only single file (flux1-dev.safetensors style) goes through diffusers'
from_single_file once, into the store; pickles and missing configs are refused with the fix."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.config_schema import ModelConfig
from tasks.config import ConfigError
from tasks.models import resolve_model
from tasks.store import Store

MODEL = ModelConfig(name="x", seed=0, arch={}, dtype="float32", max_sequence_length=32, config=None)


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
    base = resolve_model(replace(MODEL, family=family, path=None), store)
    file = tmp_path / "my_finetune.safetensors"
    expected = _finetuned_single_file(base, file)

    folder = resolve_model(replace(MODEL, family=family, path=str(file), config=str(base)), store)
    assert folder != base and (folder / "model_index.json").is_file()
    got = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert load_file(folder / "vae" / "diffusion_pytorch_model.safetensors").keys()  # the rest from model.config

    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    def no_second_conversion(*a, **k):
        raise AssertionError("converted twice")

    for cls in (FluxTransformer2DModel, SD3Transformer2DModel):
        monkeypatch.setattr(cls, "from_single_file", no_second_conversion)
    assert resolve_model(replace(MODEL, family=family, path=str(file), config=str(base)), store) == folder


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
        resolve_model(replace(MODEL, family="sd15", path=str(ckpt)), Store(tmp_path / "s"))
    st = tmp_path / "model.safetensors"
    save_file({"x": torch.zeros(1)}, str(st))
    with pytest.raises(ConfigError, match="model.config="):
        resolve_model(replace(MODEL, family="sd15", path=str(st)), Store(tmp_path / "s"))


def _fp8(sd: dict) -> dict:
    """The weight matrices in e4m3fn, the rest as they are (how fp8 transformer files are stored)."""
    return {k: v.to(torch.float8_e4m3fn) if k.endswith(".weight") and v.dim() == 2 else v for k, v in sd.items()}


def test_an_fp8_single_file_is_kept_as_stored(tmp_path):
    """Issue 43: an fp8 transformer file (SAI's layout here, mapped by diffusers' own conversion) becomes a folder
    in the file's dtypes: the fp8 matrices stay fp8, byte for byte, so the train node reads them as stored."""
    from tasks.lora_tools.transformer_layouts import to_original
    from diffusers import SD3Transformer2DModel

    from tasks.models.loading.stream_load import folder_entries, load_streamed
    from tasks.training.base_loading import WeightLoading

    store = Store(tmp_path / "store")
    base = resolve_model(replace(MODEL, family="sd3", path=None), store)
    sd = load_file(base / "transformer" / "diffusion_pytorch_model.safetensors")
    file = tmp_path / "sd3-fp8.safetensors"
    save_file(_fp8(to_original("sd3", sd)), str(file))
    folder = resolve_model(replace(MODEL, family="sd3", path=str(file), config=str(base)), store)
    got = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    expected = _fp8(sd)  # the mapping stacks, splits and swaps halves: exact in any dtype
    assert got.keys() == expected.keys()
    assert all(got[k].dtype == expected[k].dtype and torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8))
               if expected[k].dtype == torch.float8_e4m3fn else torch.equal(got[k], expected[k]) for k in got)
    assert {e.dtype for e in folder_entries(folder / "transformer").values()} >= {"F8_E4M3"}
    # model.quantize=fp8 holds the very bytes of the file for each of its fp8 matrices
    plan = WeightLoading("float8_e4m3fn", (), "cpu")
    model = load_streamed(SD3Transformer2DModel, folder / "transformer", torch.float32, plan.store)
    held = {f"{path}.weight": plan.held[m] for path, m in model.named_modules() if m in plan.held}
    fp8_matrices = [k for k, v in expected.items() if v.dtype == torch.float8_e4m3fn]
    assert set(fp8_matrices) <= set(held)
    assert all(torch.equal(held[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in fp8_matrices)


def test_a_scaled_fp8_single_file_is_dequantized(tmp_path):
    """A ComfyUI "scaled fp8" file: `.scale_weight` beside each fp8 matrix; W = fp8 x scale in the model dtype."""
    store = Store(tmp_path / "store")
    base = resolve_model(replace(MODEL, family="flux", path=None), store)
    sd = load_file(base / "transformer" / "diffusion_pytorch_model.safetensors")
    scaled, expected = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}, {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.dim() == 2:
            scale = v.abs().amax().float() / 448
            scaled[k] = (v.float() / scale).to(torch.float8_e4m3fn)
            scaled[k[: -len("weight")] + "scale_weight"] = scale.reshape(1)
            expected[k] = (scaled[k].float() * scale).to(torch.float32)  # MODEL's dtype
        else:
            scaled[k] = expected[k] = v
    file = tmp_path / "flux-scaled.safetensors"
    save_file(scaled, str(file))
    folder = resolve_model(replace(MODEL, family="flux", path=str(file), config=str(base)), store)
    got = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)  # the same arithmetic
