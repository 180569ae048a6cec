"""The Z-Image adapter encodes text itself (tokenizer + Qwen3, no pipeline around them): the tokens it keeps
(the mask) must be the bytes ZImagePipeline.encode_prompt gives, so cached text and sampling from strings
agree; the cache holds them padded to the window, zeros past the mask, so captions of any length stack."""
from __future__ import annotations

import logging

import pytest
import torch
from diffusers import ZImagePipeline

from tasks.config_schema import ModelConfig
from tasks.models import adapter_class, resolve_model
from tasks.store import Store
from tolerance import assert_close, sums

SEQ = 24
TEXTS = ["a red circle on a blue background", "", "a much longer caption about a green square on a white "
         "background that runs past the tokens the window holds here, so it is cut"]


@pytest.mark.numerics
def test_zimage_encode_text_equals_the_pipelines_encode_prompt(tmp_path, caplog):
    model = ModelConfig(family="zimage", path=None, seed=0, arch={})
    adapter = adapter_class("zimage")(resolve_model(model, Store(tmp_path / "store")), "float32", SEQ)
    with caplog.at_level(logging.WARNING, logger="loraflow"):
        encoders = adapter.load_text_encoders()
        ours = [adapter.encode_text(encoders, [t])[0] for t in TEXTS]  # one at a time, as cache_text does
        batched = adapter.encode_text(encoders, TEXTS)  # padded to the window: a batch gives the same bytes
    pipe = ZImagePipeline.from_pretrained(adapter.model_dir, transformer=None, vae=None, use_safetensors=True)
    for text, mine, in_batch in zip(TEXTS, ours, batched):
        with torch.no_grad():  # as the pipeline runs it in __call__
            embeds, _ = pipe.encode_prompt([text], do_classifier_free_guidance=False, max_sequence_length=SEQ)
        mask = mine["attention_mask"].bool()
        assert mine["prompt_embeds"].shape[0] == SEQ and mask.sum() == embeds[0].shape[0] > 0
        assert torch.equal(mine["prompt_embeds"][mask], embeds[0])
        assert torch.equal(adapter.caption_features(mine["prompt_embeds"][None], mine["attention_mask"][None])[0],
                           embeds[0])
        assert not mine["prompt_embeds"][~mask].any()  # zeros past the mask: the cached bytes are defined
        assert torch.equal(in_batch["attention_mask"], mine["attention_mask"])
        assert_close(in_batch["prompt_embeds"], mine["prompt_embeds"], **sums(encoders), what=text)  # batch of 3 or 1
    # the empty caption still has the chat template's tokens; only the long text fills the window, and it is
    # named in a warning
    assert [bool(m["attention_mask"].all()) for m in ours] == [False, False, True]
    assert "may be truncated" in caplog.text and "a much longer caption" in caplog.text
