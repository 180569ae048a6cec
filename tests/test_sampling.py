"""Sampling from cached embeddings, per family: negative prompts (their own embeddings) on Flux, SD3 and Z-Image
match the pipeline run from strings; the generator and the tensors it fills agree on device; sizes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.config_schema import ModelConfig
from tasks.config import ConfigError, config_of
from tasks.models import adapter_class, resolve_model
from tasks.store import Store
from tasks.validate import check_sizes

SEQ = 32
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry, green"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("store"))

    def make(family):
        model = ModelConfig(family=family, path=None, seed=0, arch={})
        return adapter_class(family)(resolve_model(model, store), "float32", SEQ)
    return make


def _close(a, b):
    return np.abs(np.asarray(a).astype(int) - np.asarray(b).astype(int)).max() <= 1


def _strings_pipeline(adapter):
    pipe = adapter.pipeline_cls.from_pretrained(adapter.model_dir, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_flux_negative_prompt_uses_its_own_embeddings(tiny):
    """kohya --n on Flux: true CFG with the negative's cached T5 + pooled embeddings, as FluxPipeline does
    from strings with negative_prompt and true_cfg_scale."""
    adapter = tiny("flux")
    prompt, negative, empty = adapter.encode_text(adapter.load_text_encoders(), [PROMPT, NEGATIVE, ""])
    kw = dict(width=64, height=64, steps=2, guidance=3.5, true_cfg=4.0, seed=5)
    sampler = adapter.load_sampler(None)
    with_negative = adapter.sample(sampler, prompt, negative, empty, **kw)
    reference = _strings_pipeline(adapter)(
        PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, width=64, height=64, num_inference_steps=2,
        guidance_scale=3.5, max_sequence_length=SEQ, generator=torch.Generator("cpu").manual_seed(5)).images[0]
    assert _close(with_negative, reference)
    assert not np.array_equal(np.asarray(with_negative), np.asarray(adapter.sample(sampler, prompt, None, empty, **kw)))


def test_sd3_negative_prompt_uses_its_own_embeddings(tiny):
    adapter = tiny("sd3")
    prompt, negative, empty = adapter.encode_text(adapter.load_text_encoders(), [PROMPT, NEGATIVE, ""])
    kw = dict(width=64, height=64, steps=2, guidance=4.0, true_cfg=1.0, seed=5)
    with_negative = adapter.sample(adapter.load_sampler(None), prompt, negative, empty, **kw)
    reference = _strings_pipeline(adapter)(
        PROMPT, negative_prompt=NEGATIVE, width=64, height=64, num_inference_steps=2, guidance_scale=4.0,
        max_sequence_length=SEQ, generator=torch.Generator("cpu").manual_seed(5)).images[0]
    assert _close(with_negative, reference)


def test_zimage_samples_from_cache_as_the_pipeline_from_strings(tiny):
    """Z-Image: the cached (padded) embeddings cut back to each caption's tokens give the pipeline's image
    from strings, with real CFG against the negative's own embeddings, and without CFG at guidance 0
    (Z-Image-Turbo's setting)."""
    adapter = tiny("zimage")
    prompt, negative, empty = adapter.encode_text(adapter.load_text_encoders(), [PROMPT, NEGATIVE, ""])
    sampler, strings = adapter.load_sampler(None), _strings_pipeline(adapter)
    for guidance, neg in ((4.0, NEGATIVE), (0.0, None)):
        kw = dict(width=64, height=64, steps=2, guidance=guidance, true_cfg=1.0, seed=5)
        mine = adapter.sample(sampler, prompt, negative if neg else None, empty, **kw)
        reference = strings(PROMPT, negative_prompt=neg, width=64, height=64, num_inference_steps=2,
                            guidance_scale=guidance, max_sequence_length=SEQ,
                            generator=torch.Generator("cpu").manual_seed(5)).images[0]
        assert _close(mine, reference), guidance


def test_qwenimage_samples_from_cache_as_the_pipeline_from_strings(tiny):
    """Qwen-Image: each cached caption cut back to its tokens gives the pipeline's image from strings, with
    true CFG against the negative's own embeddings, and without CFG at true_cfg 1."""
    adapter = tiny("qwenimage")
    prompt, negative, empty = adapter.encode_text(adapter.load_text_encoders(), [PROMPT, NEGATIVE, ""])
    sampler, strings = adapter.load_sampler(None), _strings_pipeline(adapter)
    for true_cfg, neg in ((4.0, NEGATIVE), (1.0, None)):
        kw = dict(width=64, height=64, steps=2, guidance=3.5, true_cfg=true_cfg, seed=5)
        mine = adapter.sample(sampler, prompt, negative if neg else None, empty, **kw)
        reference = strings(PROMPT, negative_prompt=neg, true_cfg_scale=true_cfg, width=64, height=64,
                            num_inference_steps=2, max_sequence_length=SEQ,
                            generator=torch.Generator("cpu").manual_seed(5)).images[0]
        assert _close(mine, reference), true_cfg


def test_flux2_klein_samples_from_cache_as_the_pipeline_from_strings(tiny):
    """FLUX.2 [klein]: cached embeddings give the pipeline's image from strings, with real CFG against the
    negative's own embeddings (the pipeline from strings: negative_prompt_embeds of the negative), and
    without CFG at guidance 1."""
    adapter = tiny("flux2_klein")
    prompt, negative, empty = adapter.encode_text(adapter.load_text_encoders(), [PROMPT, NEGATIVE, ""])
    sampler, strings = adapter.load_sampler(None), _strings_pipeline(adapter)
    for guidance in (4.0, 1.0):
        kw = dict(width=64, height=64, steps=2, guidance=guidance, true_cfg=1.0, seed=5)
        mine = adapter.sample(sampler, prompt, None, empty, **kw)  # the pipeline's own negative is ""
        reference = strings(prompt=PROMPT, guidance_scale=guidance, width=64, height=64, num_inference_steps=2,
                            max_sequence_length=SEQ, generator=torch.Generator("cpu").manual_seed(5)).images[0]
        assert _close(mine, reference), guidance
    with_negative = adapter.sample(sampler, prompt, negative, empty, **{**kw, "guidance": 4.0})
    neg_embeds, _ = strings.encode_prompt(NEGATIVE, max_sequence_length=SEQ)
    reference = strings(prompt=PROMPT, negative_prompt_embeds=neg_embeds, guidance_scale=4.0, width=64, height=64,
                        num_inference_steps=2, max_sequence_length=SEQ,
                        generator=torch.Generator("cpu").manual_seed(5)).images[0]
    assert _close(with_negative, reference)


@pytest.mark.parametrize("generator_device", ["cpu", "device"])
@pytest.mark.parametrize("family", ["flux", "sd3", "sdxl", "sd15", "zimage", "qwenimage", "flux2_klein"])
def test_generator_and_tensors_agree_on_device(tiny, family, generator_device, monkeypatch):
    """Every seeded draw while sampling fills a tensor on its generator's device (SimpleTuner's sampler
    crashed handing a CUDA generator CPU tensors). On this CPU-only machine both settings resolve to the
    CPU; the CUDA path is not exercised here."""
    adapter = tiny(family)
    prompt, empty = adapter.encode_text(adapter.load_text_encoders(), [PROMPT, ""])
    draws, randn = [], torch.randn

    def checked_randn(*args, generator=None, device=None, **kw):
        if generator is not None:
            draws.append((generator.device, torch.device(device or "cpu")))
        return randn(*args, generator=generator, device=device, **kw)

    monkeypatch.setattr(torch, "randn", checked_randn)
    sampler = adapter.load_sampler(None)
    image = adapter.sample(sampler, prompt, None, empty, width=64, height=64, steps=2, guidance=3.0, true_cfg=1.0,
                           seed=1, generator_device=generator_device)
    assert image.size == (64, 64) and draws
    assert all(g.type == t.type for g, t in draws), draws
    expected = "cpu" if generator_device == "cpu" else sampler._execution_device.type
    assert {g.type for g, _ in draws} == {expected}


def test_sample_sizes_must_fit_the_family():
    cfg = config_of({"model": {"family": "flux"}, "sample": {"width": 100, "height": 64}})
    errors = check_sizes(cfg, 16)
    assert errors == ["sample.width=100: must be a multiple of 16 for model.family=flux; use sample.width=96 or 112"]
    assert check_sizes(config_of({"model": {"family": "sd15"}, "sample": {"width": 104, "height": None}}), 8) == []


def test_unknown_family_is_a_config_error():
    with pytest.raises(ConfigError, match="model.family='sdxl2'"):
        adapter_class("sdxl2")
