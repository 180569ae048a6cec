"""The Flux adapter encodes text itself (no FluxPipeline around the encoders, for speed): its tensors must be
the bytes FluxPipeline.encode_prompt gives, so cached text and sampling from strings agree."""
from __future__ import annotations

import logging

import torch
from diffusers import FluxPipeline

from tasks.config_schema import ModelConfig
from tasks.models import adapter_class, resolve_model
from tasks.store import Store

SEQ = 16
TEXTS = ["a red circle on a blue background", "", "a much longer caption about a green square on a white "
         "background that runs past the sixteen tokens the T5 window holds here, so it is cut"]


def test_flux_encode_text_equals_the_pipelines_encode_prompt(tmp_path, caplog):
    model = ModelConfig(family="flux", path=None, seed=0, arch={})
    adapter = adapter_class("flux")(resolve_model(model, Store(tmp_path / "store")), "float32", SEQ)
    with caplog.at_level(logging.WARNING, logger="loraflow"):
        encoders = adapter.load_text_encoders()
        ours = [adapter.encode_text(encoders, [t])[0] for t in TEXTS]  # one at a time, as cache_text does
    pipe = FluxPipeline.from_pretrained(adapter.model_dir, transformer=None, vae=None, use_safetensors=True)
    for text, mine in zip(TEXTS, ours):
        with torch.no_grad():  # as the pipeline runs it in __call__ (grad mode picks other kernels)
            embeds, pooled, _ = pipe.encode_prompt([text], prompt_2=None, max_sequence_length=SEQ)
        assert torch.equal(mine["prompt_embeds"], embeds[0]) and torch.equal(mine["pooled_prompt_embeds"], pooled[0])
        ids = pipe.tokenizer_2([text], padding="max_length", max_length=SEQ, truncation=True,
                               return_tensors="pt").input_ids[0]
        assert torch.equal(mine["attention_mask"], (ids != pipe.tokenizer_2.pad_token_id).to(torch.int64))
    # only the long text fills the window, and it is named in a warning
    assert [m["attention_mask"].sum().item() == SEQ for m in ours] == [False, False, True]
    assert "may be truncated" in caplog.text and "a much longer caption" in caplog.text
