"""A model caption longer than the family's text window is cut when encoded: validate says which, with the
token counts (the family's last tokenizer, e.g. T5's in Flux, counted over the caption alone; the window is
model.max_sequence_length, at most what the tokenizer takes: 77 for CLIP)."""
from __future__ import annotations

from pathlib import Path


def over_limit(model_dir: str | Path, text_components: tuple[str, ...], max_tokens: int,
               captions: dict[str, str]) -> list[str]:
    """A warning per caption over the window, for {item name: caption}."""
    tokenizers = [c for c in text_components if c.startswith("tokenizer")]
    folder = Path(model_dir) / tokenizers[-1] if tokenizers else None
    if not captions or folder is None or not folder.is_dir():
        return []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    window = min(max_tokens, tokenizer.model_max_length)
    names = sorted(captions)
    counts = [len(ids) for ids in tokenizer([captions[n] for n in names], add_special_tokens=False)["input_ids"]]
    return [f"caption of {n} (made by caption.model) is {c} tokens, over the text window of {window} "
            f"({folder.name}; model.max_sequence_length={max_tokens}): the rest is cut when encoded; lower "
            f"caption.max_new_tokens or ask for a shorter caption in caption.prompt"
            for n, c in zip(names, counts) if c > window]
