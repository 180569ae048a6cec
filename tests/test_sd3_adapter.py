"""SD3 adapter (tasks/models/sd3.py) against diffusers' own StableDiffusion3Pipeline on the tiny model:
the cached-text sampling path renders what the pipeline renders from strings, the loss is deterministic
and trains the LoRA, the T5 mask matches the tokens."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402

from tasks.config_schema import TrainConfig
from tasks.models.sd3 import SD3Adapter  # noqa: E402
from tasks.models.tiny.tiny_sd3 import build_tiny_sd3  # noqa: E402
from tasks.train import item_generators  # noqa: E402
from tolerance import assert_close, sums

SEQ = 32
TRAIN = TrainConfig(weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, mode_scale=1.29)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return SD3Adapter(build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3")), "float32", SEQ)


@pytest.fixture(scope="module")
def encoders(adapter):
    return adapter.load_text_encoders()


@pytest.mark.numerics
def test_encode_text_shapes_mask_and_batch_independence(adapter, encoders):
    texts = ["a red circle", "", "a much longer caption about a green square on a white background"]
    out = adapter.encode_text(encoders, texts)
    assert len(out) == 3 and set(out[0]) == {"prompt_embeds", "pooled_prompt_embeds", "attention_mask"}
    assert out[0]["prompt_embeds"].shape == (77 + SEQ, 64)  # CLIP tokens + T5 tokens, T5 width
    assert out[0]["pooled_prompt_embeds"].shape == (64,)  # both CLIP projections
    assert out[0]["attention_mask"].shape == (SEQ,)
    n_tokens = [m.sum().item() for m in (o["attention_mask"] for o in out)]
    assert n_tokens[1] < n_tokens[0] < n_tokens[2]  # "" is just </s>
    alone = adapter.encode_text(encoders, [texts[0]])[0]  # a text's tensors do not depend on its batch
    for k in alone:  # a batch of 1 and of 3 may take other kernels: the encoders' rounding bounds the difference
        if alone[k].dtype.is_floating_point:
            assert_close(alone[k], out[0][k], **sums(encoders), what=k)
        else:
            assert torch.equal(alone[k], out[0][k]), k


def test_training_loss_is_seeded_and_trains_only_lora(adapter, encoders):
    text = adapter.encode_text(encoders, ["a red circle", "a blue square"])
    text = {k: torch.stack([t[k] for t in text]) for k in text[0]}
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    scheduler = adapter.load_train_scheduler()
    transformer = adapter.load_denoiser()
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                       target_modules=adapter.default_lora_targets()))

    def loss(seed):
        return adapter.training_loss(transformer, latents, text, TRAIN, scheduler, item_generators(seed, 1, len(latents)))

    a, b, c = loss(0), loss(0), loss(1)
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.isfinite(a)
    a.backward()
    trained = {n for n, p in transformer.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)


def test_sample_from_cache_matches_the_pipeline_from_strings(adapter, encoders):
    """Cached embeddings + the cached empty prompt as the unconditional input give the image the pipeline
    gives from strings (negative_prompt "" is what SD3 uses by default)."""
    prompt, empty, neg = adapter.encode_text(encoders, ["a red circle on a blue background", "", "blurry"])
    pipe = adapter.load_sampler(None)
    kw = dict(width=64, height=64, steps=2, guidance=4.0, true_cfg=1.0, seed=3)
    cached = np.asarray(adapter.sample(pipe, prompt, None, empty, **kw))

    full = type(pipe).from_pretrained(adapter.model_dir, use_safetensors=True)
    full.set_progress_bar_config(disable=True)
    reference = full("a red circle on a blue background", negative_prompt="", width=64, height=64,
                     num_inference_steps=2, guidance_scale=4.0, max_sequence_length=SEQ,
                     generator=torch.Generator("cpu").manual_seed(3)).images[0]
    assert np.abs(cached.astype(int) - np.asarray(reference).astype(int)).max() <= 1

    assert np.array_equal(cached, np.asarray(adapter.sample(pipe, prompt, None, empty, **kw)))  # seeded
    with_negative = np.asarray(adapter.sample(pipe, prompt, neg, empty, **kw))
    assert not np.array_equal(cached, with_negative)  # the prompt's negative replaces the empty prompt
