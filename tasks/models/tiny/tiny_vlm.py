"""A tiny, deterministic Qwen2.5-VL captioner (`caption.model=tiny_vlm`), built offline from the real classes:
Qwen2_5_VLForConditionalGeneration at a tiny width, the Qwen tokenizer of the Qwen-Image tiny model, the
Qwen2-VL image processor's config and Qwen2.5-VL-Instruct's chat template, laid out as the hub repository is
(config.json, model.safetensors, generation_config.json, tokenizer files, preprocessor_config.json,
chat_template.json), so the caption node loads it exactly as it loads Qwen/Qwen2.5-VL-7B-Instruct.

Random weights write random words, deterministically. The special tokens' output rows are zero, so greedy
decoding never picks one (a zero logit loses to the best of ~400 random ones); nor do the 256 byte tokens: a caption runs to
caption.max_new_tokens unless a test makes the end-of-turn token win (the captioner that returns nothing)."""
from __future__ import annotations

import json
from pathlib import Path

from tasks.models.tiny.common import seeder
from tasks.models.tiny.tiny_qwenimage import QWEN25VL_SPECIALS, qwen25vl_tokenizer

# Qwen/Qwen2.5-VL-7B-Instruct's chat_template.json (the processor's): an image part renders as
# <|vision_start|><|image_pad|><|vision_end|>, the pad then repeated once per merged vision patch.
QWEN25VL_INSTRUCT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen2.5-VL's preprocessor settings but a small max_pixels: a test image becomes at most 64 patches of 14 px,
# 16 vision tokens after the 2x2 merge (the real one allows 12.8 MP)
_IMAGE_PROCESSOR = dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=112 * 112,
                        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])


def build_tiny_vlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Tiny random-weight Qwen2.5-VL-Instruct folder under `out_dir`; same bytes on every build."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers import Qwen2VLImageProcessorPil

    tokenizer = qwen25vl_tokenizer(400, system="You are a helpful assistant.")
    tokenizer.chat_template = QWEN25VL_INSTRUCT_TEMPLATE  # saved as chat_template.jinja, as a recent repo has it
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN25VL_SPECIALS}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 2, 4]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    model = seeder(seed, 1)(0, lambda: Qwen2_5_VLForConditionalGeneration(config))
    with torch.no_grad():  # no special token is ever the best next token (module docstring), nor a lone byte:
        model.lm_head.weight[list(ids.values())] = 0.0  # the words are the BPE's merges (readable text)
        model.lm_head.weight[:256] = 0.0
        # Sharp attention, so that the few vision tokens decide the words: at the init's scale the answer's
        # attention is near uniform over the ~60 prompt tokens and the 12 demo images got 2 distinct captions
        # (8 tokens each), with q/k x20: 9
        for name, module in model.model.language_model.named_modules():
            if name.endswith(("q_proj", "k_proj")):
                module.weight.mul_(20.0)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # as Qwen2.5-VL-7B-Instruct's generation_config.json: either end token ends the answer
    GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"],
                     do_sample=False).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(**_IMAGE_PROCESSOR).save_pretrained(out_dir)
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": QWEN25VL_INSTRUCT_TEMPLATE}, indent=2))
    return out_dir
