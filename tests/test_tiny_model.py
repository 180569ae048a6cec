"""Tests for the tiny offline Flux pipeline used as a stand-in for FLUX.1-dev in tests."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import FluxPipeline  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

from tasks.models.tiny.tiny_flux import build_tiny_flux  # noqa: E402

GEN_KWARGS = dict(height=64, width=64, num_inference_steps=2, max_sequence_length=32, output_type="pil")
PROMPT = "a photo of a red circle on a blue background"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _generate(pipe: FluxPipeline, seed: int = 0) -> np.ndarray:
    image = pipe(PROMPT, generator=torch.Generator().manual_seed(seed), **GEN_KWARGS).images[0]
    assert image.size == (64, 64)
    return np.asarray(image)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_flux(tmp_path_factory.mktemp("tiny") / "flux", seed=0)


def test_build_is_deterministic(tiny_dir, tmp_path):
    rng_state = torch.get_rng_state()
    again = _files(build_tiny_flux(tmp_path / "again", seed=0))
    assert torch.equal(rng_state, torch.get_rng_state()), "building must not touch the global RNG"
    first = _files(tiny_dir)
    assert "transformer/diffusion_pytorch_model.safetensors" in first
    assert "model_index.json" in first
    assert first.keys() == again.keys()
    for name in first:
        assert first[name] == again[name], f"{name} differs between two builds with the same seed"

    other = _files(build_tiny_flux(tmp_path / "other", seed=1))
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert other[weights] != first[weights]
    assert other["tokenizer/tokenizer.json"] == first["tokenizer/tokenizer.json"]  # tokenizers do not use the seed


def test_arch_overrides(tmp_path):
    out = build_tiny_flux(tmp_path / "big", arch={"num_layers": 2})
    assert '"num_layers": 2' in (out / "transformer" / "config.json").read_text()
    with pytest.raises(ValueError, match="unknown arch keys"):
        build_tiny_flux(tmp_path / "bad", arch={"no_such_key": 1})


def test_pipeline_loads_and_generates(tiny_dir):
    pipe = FluxPipeline.from_pretrained(tiny_dir)
    assert pipe.vae_scale_factor == 8
    assert pipe.text_encoder.config.eos_token_id == pipe.tokenizer.eos_token_id
    assert pipe.tokenizer_2.pad_token_id == 0 and pipe.tokenizer_2.eos_token_id == 1
    first, second = _generate(pipe), _generate(pipe)
    assert first.shape == (64, 64, 3)
    assert np.array_equal(first, second)
    assert first.std() > 0  # not a blank image


def test_lora_round_trip(tiny_dir, tmp_path):
    base = _generate(FluxPipeline.from_pretrained(tiny_dir))

    transformer = FluxPipeline.from_pretrained(tiny_dir).transformer
    transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v", "to_out.0"])
    )
    # peft's "gaussian" init zeroes lora_B (the adapter starts as a no-op); give it weights that matter.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    state_dict = get_peft_model_state_dict(transformer)
    assert state_dict and all("lora" in k for k in state_dict)
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=state_dict)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()

    pipe = FluxPipeline.from_pretrained(tiny_dir)
    pipe.load_lora_weights(tmp_path)
    assert pipe.get_active_adapters()
    with_lora = _generate(pipe)
    assert not np.array_equal(base, with_lora)
