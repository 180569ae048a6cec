"""The Qwen-Image adapter caches QwenImagePipeline.encode_prompt's own tensors, padded to the window with
their mask: the real tokens must be the pipeline's bytes, the 34 tokens the pipeline drops must be exactly
the tiny tokenizer's system-template prefix (as with the real Qwen2.5-VL tokenizer), and training with the
padded batch must give the loss of each caption at its own length."""
from __future__ import annotations

import pytest
import torch
from diffusers import QwenImagePipeline

from tasks.config_schema import ModelConfig, TrainConfig
from tasks.models import adapter_class, resolve_model
from tasks.store import Store
from tolerance import assert_close, sums

SEQ = 24
TEXTS = ["a red circle on a blue background", "", "a much longer caption about a green square on a white "
         "background that runs past the tokens the window holds here, so it is cut"]


def test_qwenimage_encode_text_equals_the_pipelines_encode_prompt(tmp_path):
    model = ModelConfig(family="qwenimage", path=None, seed=0, arch={})
    adapter = adapter_class("qwenimage")(resolve_model(model, Store(tmp_path / "store")), "float32", SEQ)
    encoders = adapter.load_text_encoders()
    ours = [adapter.encode_text(encoders, [t])[0] for t in TEXTS]  # one at a time, as cache_text does
    pipe = QwenImagePipeline.from_pretrained(adapter.model_dir, transformer=None, vae=None, use_safetensors=True)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    lengths = []
    for text, mine in zip(TEXTS, ours):
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt([text], max_sequence_length=SEQ)
        n = embeds.shape[1]
        lengths.append(n)
        assert mine["prompt_embeds"].shape[0] == SEQ and int(mine["attention_mask"].sum()) == n
        assert torch.equal(mine["prompt_embeds"][:n], embeds[0]) and not mine["prompt_embeds"][n:].any()
    # the empty caption keeps the template's closing tokens; the long one is cut at the window
    assert 0 < lengths[1] < lengths[0] < lengths[2] == SEQ


@pytest.mark.numerics
def test_padded_batch_trains_as_each_caption_alone(tmp_path):
    model = ModelConfig(family="qwenimage", path=None, seed=0, arch={})
    adapter = adapter_class("qwenimage")(resolve_model(model, Store(tmp_path / "store")), "float32", SEQ)
    texts = adapter.encode_text(adapter.load_text_encoders(), TEXTS[:2])
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29)
    denoiser, scheduler = adapter.load_denoiser(), adapter.load_train_scheduler()
    gens = lambda: [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]  # noqa: E731
    with torch.no_grad():
        batch = {k: torch.stack([t[k] for t in texts]) for k in texts[0]}
        both = adapter.training_loss(denoiser, latents, batch, cfg, scheduler, gens())
        alone = []
        for i, t in enumerate(texts):
            n = int(t["attention_mask"].sum())
            one = {"prompt_embeds": t["prompt_embeds"][None, :n], "attention_mask": t["attention_mask"][None, :n]}
            alone.append(adapter.training_loss(denoiser, latents[i : i + 1], one, cfg, scheduler, [gens()[i]]))
    # padded to the longer text (masked) or not, one item or two: the denoiser's rounding, then a mean of 2
    assert_close(both, torch.stack(alone).mean(), **sums(denoiser), what="batched loss")
