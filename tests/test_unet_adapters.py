"""SDXL / SD1.5 adapters (tasks/models/sdxl.py, sd15.py on tasks/models/bases/unet.py) against diffusers' own
pipelines on the tiny models: cached-text sampling renders what the pipeline renders from strings, the
loss is seeded, follows the scheduler's prediction type and trains only the LoRA, and the saved file
loads into the pipeline with its trained alpha."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

from tasks.config_schema import TrainConfig
from tasks.models.sd15 import SD15Adapter  # noqa: E402
from tasks.models.sdxl import SDXLAdapter  # noqa: E402
from tasks.models.tiny.tiny_unet import build_tiny_sd15, build_tiny_sdxl  # noqa: E402
from tasks.train import item_generators  # noqa: E402
from tolerance import assert_close, sums

FAMILIES = {"sdxl": (SDXLAdapter, build_tiny_sdxl, 64), "sd15": (SD15Adapter, build_tiny_sd15, 32)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def adapter(request, tmp_path_factory):
    cls, build, _ = FAMILIES[request.param]
    return cls(build(tmp_path_factory.mktemp(f"tiny_{request.param}")), "float32", 77)


@pytest.fixture(scope="module")
def encoders(adapter):
    return adapter.load_text_encoders()


@pytest.mark.numerics
def test_encode_text_shapes_mask_and_batch_independence(adapter, encoders):
    width = FAMILIES[adapter.family][2]
    texts = ["a red circle", "", "a much longer caption about a green square on a white background"]
    out = adapter.encode_text(encoders, texts)
    names = {"prompt_embeds", "attention_mask"} | ({"pooled_prompt_embeds"} if adapter.family == "sdxl" else set())
    assert len(out) == 3 and set(out[0]) == names
    assert out[0]["prompt_embeds"].shape == (77, width)
    if adapter.family == "sdxl":
        assert out[0]["pooled_prompt_embeds"].shape == (32,)
    n_tokens = [o["attention_mask"].sum().item() for o in out]
    assert n_tokens[1] == 2 and n_tokens[1] < n_tokens[0] < n_tokens[2]  # "" is bos + eos
    alone = adapter.encode_text(encoders, [texts[0]])[0]  # a text's tensors do not depend on its batch
    for k in alone:  # a batch of 1 and of 3 may take other kernels: the encoders' rounding bounds the difference
        if alone[k].dtype.is_floating_point:
            assert_close(alone[k], out[0][k], **sums(encoders), what=k)
        else:
            assert torch.equal(alone[k], out[0][k]), k


def _lora_unet(adapter, alpha=4):
    unet = adapter.load_denoiser()
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=alpha, init_lora_weights="gaussian",
                                target_modules=adapter.default_lora_targets()))
    return unet


def _batch(adapter, encoders):
    text = adapter.encode_text(encoders, ["a red circle", "a blue square"])
    return {k: torch.stack([t[k] for t in text]) for k in text[0]}


def test_training_loss_is_seeded_and_trains_only_lora(adapter, encoders):
    text = _batch(adapter, encoders)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    scheduler = adapter.load_train_scheduler()
    unet = _lora_unet(adapter)

    def loss(seed):
        return adapter.training_loss(unet, latents, text, TrainConfig(), scheduler, item_generators(seed, 1, len(latents)))

    a, b, c = loss(0), loss(0), loss(1)
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.isfinite(a)
    a.backward()
    trained = {n for n, p in unet.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)


def test_v_prediction_changes_the_target(adapter, encoders):
    from diffusers import DDPMScheduler

    text = _batch(adapter, encoders)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    unet = _lora_unet(adapter)
    eps = adapter.load_train_scheduler()
    v = DDPMScheduler.from_config(eps.config, prediction_type="v_prediction")
    with torch.no_grad():
        le, lv = (adapter.training_loss(unet, latents, text, TrainConfig(), s, item_generators(0, 1, len(latents))) for s in (eps, v))
    assert torch.isfinite(lv) and not torch.equal(le, lv)


def test_saved_lora_loads_with_its_alpha(adapter, tmp_path):
    unet = _lora_unet(adapter, alpha=2)
    for name, p in unet.named_parameters():  # a non-zero delta (lora_B starts at zero)
        if "lora_B" in name:
            p.data.normal_(generator=torch.Generator().manual_seed(0))
    path = adapter.save_lora(get_peft_model_state_dict(unet), tmp_path, unet.peft_config["default"].to_dict())
    pipe = adapter.load_sampler(path)
    assert pipe.unet.peft_config["default_0"].lora_alpha == 2
    ours = dict(unet.named_parameters())
    loaded = {n.replace(".default_0.", ".default."): p for n, p in pipe.unet.named_parameters() if "lora_" in n}
    assert loaded and all(torch.equal(p, ours[n]) for n, p in loaded.items())


def test_sample_from_cache_matches_the_pipeline_from_strings(adapter, encoders):
    """Cached embeddings give the image the pipeline gives from strings, with and without a negative."""
    prompt, empty, neg = adapter.encode_text(encoders, ["a red circle on a blue background", "", "blurry"])
    pipe = adapter.load_sampler(None)
    kw = dict(width=64, height=64, steps=2, guidance=4.0, true_cfg=1.0, seed=3)
    full = type(pipe).from_pretrained(adapter.model_dir, use_safetensors=True)
    full.set_progress_bar_config(disable=True)

    def reference(**negative):
        image = full("a red circle on a blue background", width=64, height=64, num_inference_steps=2,
                     guidance_scale=4.0, generator=torch.Generator("cpu").manual_seed(3), **negative).images[0]
        return np.asarray(image)

    cached = np.asarray(adapter.sample(pipe, prompt, None, empty, **kw))
    assert np.abs(cached.astype(int) - reference().astype(int)).max() <= 1
    assert np.array_equal(cached, np.asarray(adapter.sample(pipe, prompt, None, empty, **kw)))  # seeded
    with_negative = np.asarray(adapter.sample(pipe, prompt, neg, empty, **kw))
    assert np.abs(with_negative.astype(int) - reference(negative_prompt="blurry").astype(int)).max() <= 1
    assert not np.array_equal(cached, with_negative)
