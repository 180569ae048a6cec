"""Tests for the tiny offline pipelines of tasks/models/tiny/: SD3 (sd3.py), SDXL / SD1.5 (unet.py), Z-Image
(zimage.py), Qwen-Image (qwenimage.py), FLUX.2 [klein] (flux2.py) and FLUX.2 [dev] (flux2_dev.py)."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import (  # noqa: E402
    Flux2KleinPipeline, Flux2Pipeline, QwenImagePipeline, StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline, ZImagePipeline,
)
from diffusers.utils import convert_state_dict_to_diffusers  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

from tasks.models.tiny.tiny_flux2 import build_tiny_flux2  # noqa: E402
from tasks.models.tiny.tiny_flux2_dev import build_tiny_flux2_dev  # noqa: E402
from tasks.models.tiny.tiny_qwenimage import build_tiny_qwenimage  # noqa: E402
from tasks.models.tiny.tiny_sd3 import build_tiny_sd3  # noqa: E402
from tasks.models.tiny.tiny_unet import build_tiny_sd15, build_tiny_sdxl  # noqa: E402
from tasks.models.tiny.tiny_zimage import build_tiny_zimage  # noqa: E402

PROMPT = "a photo of a red circle on a blue background"
BASE_KWARGS = dict(height=64, width=64, num_inference_steps=2, output_type="pil")

# family -> (builder, pipeline class, denoiser attribute, save_lora_weights keyword, extra call kwargs)
FAMILIES = {
    "sd3": (build_tiny_sd3, StableDiffusion3Pipeline, "transformer", "transformer_lora_layers",
            dict(max_sequence_length=32)),
    "sdxl": (build_tiny_sdxl, StableDiffusionXLPipeline, "unet", "unet_lora_layers", {}),
    "sd15": (build_tiny_sd15, StableDiffusionPipeline, "unet", "unet_lora_layers", {}),
    "zimage": (build_tiny_zimage, ZImagePipeline, "transformer", "transformer_lora_layers",
               dict(max_sequence_length=32, guidance_scale=2.0)),
    "qwenimage": (build_tiny_qwenimage, QwenImagePipeline, "transformer", "transformer_lora_layers",
                  dict(max_sequence_length=32, negative_prompt=" ", true_cfg_scale=2.0)),
    "flux2_klein": (build_tiny_flux2, Flux2KleinPipeline, "transformer", "transformer_lora_layers",
                    dict(max_sequence_length=32, guidance_scale=2.0)),
    "flux2_dev": (build_tiny_flux2_dev, Flux2Pipeline, "transformer", "transformer_lora_layers",
                  dict(max_sequence_length=64, guidance_scale=2.0)),
}
DENOISER_WEIGHTS = {"sd3": "transformer/diffusion_pytorch_model.safetensors",
                    "sdxl": "unet/diffusion_pytorch_model.safetensors",
                    "sd15": "unet/diffusion_pytorch_model.safetensors",
                    "zimage": "transformer/diffusion_pytorch_model.safetensors",
                    "qwenimage": "transformer/diffusion_pytorch_model.safetensors",
                    "flux2_klein": "transformer/diffusion_pytorch_model.safetensors",
                    "flux2_dev": "transformer/diffusion_pytorch_model.safetensors"}
# An arch key that deepens the text encoder, per family (the CLIP towers; Z-Image's Qwen3).
TEXT_LAYERS_KEY = {"zimage": "qwen_layers", "qwenimage": "qwen_layers", "flux2_klein": "qwen_layers",
                   "flux2_dev": "mistral_layers"}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _generate(family: str, pipe, seed: int = 0) -> np.ndarray:
    extra = FAMILIES[family][4]
    image = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(seed), **BASE_KWARGS, **extra).images[0]
    assert image.size == (64, 64)
    return np.asarray(image)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def built(family, tmp_path_factory) -> Path:
    return FAMILIES[family][0](tmp_path_factory.mktemp(family) / "model", seed=0)


def test_build_is_deterministic(family, built, tmp_path):
    build = FAMILIES[family][0]
    rng_state = torch.get_rng_state()
    again = _files(build(tmp_path / "again", seed=0))
    assert torch.equal(rng_state, torch.get_rng_state()), "building must not touch the global RNG"
    first = _files(built)
    assert "model_index.json" in first and DENOISER_WEIGHTS[family] in first
    assert first.keys() == again.keys()
    for name in first:
        assert first[name] == again[name], f"{name} differs between two builds with the same seed"
    other = _files(build(tmp_path / "other", seed=1))
    assert other[DENOISER_WEIGHTS[family]] != first[DENOISER_WEIGHTS[family]]


def test_arch_overrides(family, tmp_path):
    build = FAMILIES[family][0]
    out = build(tmp_path / "big", arch={TEXT_LAYERS_KEY.get(family, "clip_layers"): 3})
    assert '"num_hidden_layers": 3' in (out / "text_encoder" / "config.json").read_text()
    with pytest.raises(ValueError, match="unknown arch keys"):
        build(tmp_path / "bad", arch={"no_such_key": 1})


def test_pipeline_loads_and_generates(family, built):
    pipe = FAMILIES[family][1].from_pretrained(built)
    assert pipe.vae_scale_factor == 8
    for name in ("text_encoder", "text_encoder_2"):
        encoder, tokenizer = getattr(pipe, name, None), getattr(pipe, name.replace("text_encoder", "tokenizer"), None)
        if encoder is not None:
            config = getattr(encoder.config, "text_config", encoder.config)  # Qwen2.5-VL: the text model's
            assert config.eos_token_id == tokenizer.eos_token_id
    first, second = _generate(family, pipe), _generate(family, pipe)
    assert first.shape == (64, 64, 3)
    assert np.array_equal(first, second)
    assert first.std() > 0  # not a blank image
    assert not np.array_equal(first, _generate(family, pipe, seed=1))


def test_lora_round_trip(family, built, tmp_path):
    _, pipeline_cls, denoiser_name, lora_kwarg, _ = FAMILIES[family]
    base = _generate(family, pipeline_cls.from_pretrained(built))

    denoiser = getattr(pipeline_cls.from_pretrained(built), denoiser_name)
    denoiser.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v", "to_out.0"])
    )
    # peft zeroes lora_B (the adapter starts as a no-op); give it weights that matter.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    state_dict = get_peft_model_state_dict(denoiser)
    assert state_dict and all("lora" in k for k in state_dict)
    if denoiser_name == "unet":  # as diffusers' SD/SDXL LoRA training scripts do
        state_dict = convert_state_dict_to_diffusers(state_dict)
    pipeline_cls.save_lora_weights(tmp_path, **{lora_kwarg: state_dict})
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()

    pipe = pipeline_cls.from_pretrained(built)
    pipe.load_lora_weights(tmp_path)
    assert pipe.get_active_adapters()
    assert not np.array_equal(base, _generate(family, pipe))
