"""Qwen-Image 2.1's text processor without torchvision (transformers builds Qwen3VLProcessor only with its video
processor): what both the adapter (tasks/models/qwenimage21.py, for real folders) and the tiny builder need; here, in
the one package both may import (tests/test_imports.py LAYERS: the tiny builders import nothing of an adapter)."""
from __future__ import annotations

import functools


@functools.cache
def text_processor_cls():
    import torch
    from transformers import ProcessorMixin

    class TextProcessor(ProcessorMixin):
        """What QwenImage21Pipeline asks of its Qwen3VLProcessor for text-to-image, without torchvision (transformers
        builds the real one only with its video processor): `tokenizer`, `apply_chat_template` (the system turn's
        length) and `__call__` on text, which ProcessorMixin.__call__ answers with the tokenizer's input_ids and
        attention_mask (Qwen3VLProcessor.text_kwargs: no token_type_ids) and `mm_token_type_ids` (1 at image, 2 at
        video tokens: Qwen3VLProcessor.return_mm_token_type_ids). A ProcessorMixin, so from_pretrained takes it."""

        def __init__(self, tokenizer, chat_template: str | None = None):  # not ProcessorMixin's: no checks
            self.tokenizer, self.chat_template = tokenizer, chat_template or tokenizer.chat_template

        def apply_chat_template(self, conversation, tokenize=False, return_dict=False, add_generation_prompt=False,
                                **kwargs):
            text = self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
            return [self.tokenizer(text, return_token_type_ids=False)["input_ids"]] if tokenize else text

        def __call__(self, text, images=None, padding=True, padding_side=None, return_tensors="pt", **kwargs):
            from transformers import BatchFeature

            if images:
                raise NotImplementedError("qwenimage21: condition images need the real Qwen3VLProcessor (torchvision)")
            enc = self.tokenizer(text, padding=padding, padding_side=padding_side, return_token_type_ids=False,
                                 return_tensors=return_tensors)
            ids = enc["input_ids"]
            kinds = torch.zeros_like(ids)
            for kind, token in ((1, "<|image_pad|>"), (2, "<|video_pad|>")):
                kinds[ids == self.tokenizer.convert_tokens_to_ids(token)] = kind
            return BatchFeature({**enc, "mm_token_type_ids": kinds})

        def __repr__(self):
            return f"TextProcessor({type(self.tokenizer).__name__})"

    return TextProcessor
