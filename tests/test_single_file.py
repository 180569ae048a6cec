"""Single-file (A1111 / civitai style) SD1.5 and SDXL checkpoints: a tiny diffusers folder written in the
ORIGINAL key layout (tests/ldm_convert.py) must come back through diffusers' from_single_file, and through
loraflow's resolve_model, with exactly the same weights and images. Offline: config= a local folder."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline  # noqa: E402
from diffusers.loaders.single_file_utils import infer_diffusers_model_type  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tasks.config_schema import ModelConfig
from tasks.models.tiny.tiny_unet import build_tiny_sd15, build_tiny_sdxl  # noqa: E402
from ldm_convert import to_ldm_sd15, to_ldm_sdxl  # noqa: E402

PROMPT = "a photo of a red circle on a blue background"
RENDER = dict(height=64, width=64, num_inference_steps=2, output_type="np")
# SDXL: text_encoder_2 must be wider than text_encoder, as in the real model (768 vs 1280); with equal widths
# diffusers' from_single_file loads CLIP-L's weights into text_encoder_2 (see tests/ldm_convert.py).
SDXL_ARCH = {"clip_2_hidden_size": 48}


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys(), f"{what}: {sorted(set(sa) ^ set(sb))}"
    different = [k for k in sa if sa[k].device.type == "meta" or sb[k].device.type == "meta"
                 or not torch.equal(sa[k], sb[k])]
    assert not different, f"{what}: {len(different)} tensors differ, e.g. {different[:5]}"


def _render(pipe) -> np.ndarray:
    return pipe(PROMPT, generator=torch.Generator("cpu").manual_seed(0), **RENDER).images


def _roundtrip(tmp: Path, folder: Path, state_dict: dict, cls, components: tuple[str, ...]) -> None:
    file = tmp / "model.safetensors"
    save_file(state_dict, file)
    # config must be a str (a Path is rejected by the per-model from_single_file as "not a repo id or path")
    single = cls.from_single_file(str(file), config=str(folder), local_files_only=True)
    folder_pipe = cls.from_pretrained(folder, local_files_only=True)
    for name in components:
        _assert_same_weights(getattr(folder_pipe, name), getattr(single, name), name)
    assert type(single.scheduler) is type(folder_pipe.scheduler)
    assert single.scheduler.config == folder_pipe.scheduler.config
    np.testing.assert_array_equal(_render(single), _render(folder_pipe))


@pytest.fixture(scope="module")
def sd15(tmp_path_factory) -> Path:
    return build_tiny_sd15(tmp_path_factory.mktemp("sd15") / "model", seed=0)


@pytest.fixture(scope="module")
def sd15_file(sd15, tmp_path_factory) -> Path:
    file = tmp_path_factory.mktemp("sd15_file") / "tiny-sd15.safetensors"
    save_file(to_ldm_sd15(sd15), file)
    return file


def test_sd15_original_layout_roundtrip(sd15, tmp_path):
    state_dict = to_ldm_sd15(sd15)
    prefixes = {k.split(".")[0] for k in state_dict}
    assert prefixes == {"model", "first_stage_model", "cond_stage_model"}
    assert "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight" in state_dict
    assert state_dict["first_stage_model.encoder.mid.attn_1.q.weight"].ndim == 4  # 1x1 conv, as in ldm
    assert infer_diffusers_model_type(state_dict) == "v1"
    _roundtrip(tmp_path, sd15, state_dict, StableDiffusionPipeline, ("unet", "vae", "text_encoder"))


def test_sd15_real_shaped_keys(tmp_path):
    """SD1.5's real block structure (4 levels, 2 layers each, VAE with 2 resnets per level) at tiny width:
    the keys that real files have (and that diffusers detects v1 by) are where the arithmetic puts them."""
    folder = build_tiny_sd15(tmp_path / "model", arch={"block_out_channels": (32, 32, 32, 64), "layers_per_block": 2,
                                                       "vae_layers_per_block": 2})
    state_dict = to_ldm_sd15(folder)
    unet, vae = "model.diffusion_model.", "first_stage_model."
    for key in [unet + "output_blocks.11.0.skip_connection.weight",  # CHECKPOINT_KEY_NAMES["v1"]
                unet + "input_blocks.3.0.op.weight", unet + "input_blocks.9.0.op.weight",
                unet + "input_blocks.8.1.transformer_blocks.0.attn2.to_k.weight",
                unet + "output_blocks.2.1.conv.weight",  # level without attention: upsampler at .1
                unet + "output_blocks.5.2.conv.weight", unet + "output_blocks.8.2.conv.weight",
                unet + "middle_block.1.proj_in.weight", unet + "middle_block.2.emb_layers.1.weight",
                vae + "encoder.down.2.block.1.conv2.weight", vae + "decoder.up.3.block.2.norm1.weight",
                vae + "decoder.up.1.upsample.conv.weight", vae + "encoder.down.0.downsample.conv.weight"]:
        assert key in state_dict, key
    assert not any(k.startswith((unet + "input_blocks.12.", unet + "output_blocks.12.")) for k in state_dict)
    file = tmp_path / "model.safetensors"
    save_file(state_dict, file)
    single = StableDiffusionPipeline.from_single_file(str(file), config=str(folder), local_files_only=True)
    folder_pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_weights(getattr(folder_pipe, name), getattr(single, name), name)


def test_sdxl_original_layout_roundtrip(tmp_path):
    folder = build_tiny_sdxl(tmp_path / "model", seed=0, arch=SDXL_ARCH)
    state_dict = to_ldm_sdxl(folder)
    prefixes = {".".join(k.split(".")[:3]) if k.startswith("conditioner") else k.split(".")[0] for k in state_dict}
    assert prefixes == {"model", "first_stage_model", "conditioner.embedders.0", "conditioner.embedders.1"}
    assert "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight" in state_dict
    assert "model.diffusion_model.label_emb.0.0.weight" in state_dict
    _roundtrip(tmp_path, folder, state_dict, StableDiffusionXLPipeline,
               ("unet", "vae", "text_encoder", "text_encoder_2"))


def test_sdxl_equal_clip_widths_refused(tmp_path):
    folder = build_tiny_sdxl(tmp_path / "model", seed=0)  # default arch: both CLIPs 32 wide
    with pytest.raises(ValueError, match="text_encoder_2"):
        to_ldm_sdxl(folder)


def _model_cfg(file: Path, config: Path) -> ModelConfig:
    return ModelConfig(family="sd15", path=str(file), config=str(config), seed=0, arch={}, dtype="float32",
                       max_sequence_length=77, name="x")


def test_resolve_model_converts_single_file_once(sd15, sd15_file, tmp_path, monkeypatch):
    from tasks.models import resolve_model
    from tasks.store import Store

    store = Store(tmp_path / "store")
    calls = []
    original = StableDiffusionPipeline.from_single_file.__func__

    def counting(cls, *args, **kwargs):
        calls.append(args)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(StableDiffusionPipeline, "from_single_file", classmethod(counting))
    first = resolve_model(_model_cfg(sd15_file, sd15), store)
    assert len(calls) == 1, "the file must be read with from_single_file"
    assert Path(first).resolve().is_relative_to(store.root), "the converted folder is a store entry"
    assert (Path(first) / "model_index.json").is_file()
    for name in ("unet", "vae", "text_encoder"):
        ours, theirs = (load_file(next((root / name).glob("*.safetensors"))) for root in (Path(first), sd15))
        assert ours.keys() == theirs.keys(), name
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name

    def refuse(cls, *args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(StableDiffusionPipeline, "from_single_file", classmethod(refuse))
    assert resolve_model(_model_cfg(sd15_file, sd15), store) == first
