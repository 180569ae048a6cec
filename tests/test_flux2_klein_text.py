"""The FLUX.2 [klein] adapter caches Flux2KleinPipeline.encode_prompt's tensors (Qwen3's hidden states 9, 18,
27 of the chat-templated caption, thinking off): they must be the pipeline's bytes, one caption at a time
or in a batch, and the tiny text encoder must be deep enough for those layers."""
from __future__ import annotations

import torch
from diffusers import Flux2KleinPipeline

from tasks.config_schema import ModelConfig
from tasks.models import adapter_class, resolve_model
from tasks.store import Store

SEQ = 24
TEXTS = ["a red circle on a blue background", "", "a much longer caption about a green square on a white "
         "background that runs past the tokens the window holds here, so it is cut"]


def test_flux2_klein_encode_text_equals_the_pipelines_encode_prompt(tmp_path):
    model = ModelConfig(family="flux2_klein", path=None, seed=0, arch={})
    adapter = adapter_class("flux2_klein")(resolve_model(model, Store(tmp_path / "store")), "float32", SEQ)
    encoders = adapter.load_text_encoders()
    ours = [adapter.encode_text(encoders, [t])[0] for t in TEXTS]
    pipe = Flux2KleinPipeline.from_pretrained(adapter.model_dir, transformer=None, vae=None, use_safetensors=True)
    assert pipe.text_encoder.config.num_hidden_layers >= 27  # hidden_states[27] exists, as in Qwen3-4B/8B
    chat = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert chat.endswith("<think>\n\n</think>\n\n")  # Qwen3's template with thinking off
    for text, mine in zip(TEXTS, ours):
        with torch.no_grad():
            embeds, _ = pipe.encode_prompt([text], max_sequence_length=SEQ)
        assert mine["prompt_embeds"].shape == (SEQ, 3 * pipe.text_encoder.config.hidden_size)
        assert torch.equal(mine["prompt_embeds"], embeds[0])
