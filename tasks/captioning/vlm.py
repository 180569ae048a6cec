"""A vision-language model run through transformers, from a local folder (a hub id is downloaded first): the
Qwen2.5-VL and Qwen3-VL instruct models (Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
and what AutoModelForImageTextToText maps a folder's config to with the same processor layout).

transformers builds these models' processors only with torchvision (their video processor), which loraflow does
not install; the processor's work is done here as Qwen2_5_VLProcessor does it for one image: the chat template,
the image processor's patches (the PIL one: the same bytes on every machine), `<|image_pad|>` repeated once per
merged patch. The model loads as cache_text loads a text encoder (tasks/models/loading/text_load.py):
caption.quantize stores its Linears in fp8 / int8 / nf4 as they stream in, caption.offload keeps its layers on
the host. Greedy decoding unless caption.temperature > 0, then sampled from caption.seed, per image."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tasks.lazy import lazy

torch = lazy("torch")
log = logging.getLogger("loraflow")
IMAGE_PAD = "<|image_pad|>"


class Captioner:
    """caption(images) -> captions, with a loaded model; `close()` frees it before the next node."""

    def __init__(self, folder: Path, dtype: str, loading, device: str, settings: dict):
        from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

        from tasks.models.loading.text_load import load_text_model

        self.folder, self.settings, self.device = Path(folder), settings, device
        config = AutoConfig.from_pretrained(self.folder)
        cls = AutoModelForImageTextToText._model_mapping[type(config)]
        self.dtype = getattr(torch, dtype)
        self.model = load_text_model(cls, self.folder, self.dtype, loading, device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        # caption.max_pixels: fewer vision tokens (memory, speed) where the folder's preprocessor allows more
        self.images = Qwen2VLImageProcessorPil.from_pretrained(self.folder)
        if settings.get("max_pixels") and settings["max_pixels"] < self.images.size["longest_edge"]:
            self.images = Qwen2VLImageProcessorPil.from_pretrained(self.folder, max_pixels=settings["max_pixels"])
        self.template = chat_template(self.folder, self.tokenizer)
        self.pad_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.end_ids = _end_ids(self.folder, self.tokenizer)

    def prompt_ids(self, image) -> tuple[list[int], dict]:
        """The token ids of the chat (system, the image's pads, the prompt, the assistant's turn) and the
        image's vision inputs."""
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.settings["prompt"]}]}]
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True)
        vision = dict(self.images(images=[image], return_tensors="pt"))
        pads = int(vision["image_grid_thw"].prod()) // self.images.merge_size ** 2
        ids = self.tokenizer(text.replace(IMAGE_PAD, IMAGE_PAD * pads), add_special_tokens=False)["input_ids"]
        return ids, vision

    def caption(self, images: list) -> list[str]:
        """One caption per PIL image; a batch is left-padded (each row's result can differ from its unbatched
        one only by ties in the last float digit: caption.batch_size=1, the default, has none)."""
        rows = [self.prompt_ids(img) for img in images]
        width = max(len(ids) for ids, _ in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.end_ids[0]
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in rows], device=self.device)
        vision = {"pixel_values": torch.cat([v["pixel_values"] for _, v in rows]).to(self.device, self.dtype),
                  "image_grid_thw": torch.cat([v["image_grid_thw"] for _, v in rows]).to(self.device)}
        s = self.settings
        sample = s["temperature"] > 0
        with torch.no_grad(), torch.random.fork_rng(devices=[] if self.device == "cpu" else [self.device]):
            torch.manual_seed(s["seed"])
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, **vision,
                                      max_new_tokens=s["max_new_tokens"], do_sample=sample,
                                      **({"temperature": s["temperature"]} if sample else {}),
                                      eos_token_id=self.end_ids, pad_token_id=pad)
        new = out[:, width:].tolist()
        return [self.tokenizer.decode(_until_end(ids, self.end_ids), skip_special_tokens=True).strip() for ids in new]

    def close(self) -> None:
        del self.model
        from tasks.models.loading.stream_load import return_freed_memory

        return_freed_memory()
        if self.device != "cpu":
            torch.cuda.empty_cache()


def chat_template(folder: Path, tokenizer) -> str:
    """The processor's chat template (chat_template.jinja or .json, as the hub repositories hold it), else the
    tokenizer's."""
    jinja, js = folder / "chat_template.jinja", folder / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text()
    if js.is_file():
        return json.loads(js.read_text())["chat_template"]
    if tokenizer.chat_template:
        return tokenizer.chat_template
    raise FileNotFoundError(f"{folder}: no chat template (chat_template.jinja / chat_template.json); caption.model "
                            "must be an instruct (chat) vision-language model such as Qwen/Qwen2.5-VL-7B-Instruct")


def _end_ids(folder: Path, tokenizer) -> list[int]:
    """The ids that end the answer: generation_config.json's eos_token_id(s), else the tokenizer's eos."""
    gen = folder / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos = tokenizer.eos_token_id if eos is None else eos
    return [eos] if isinstance(eos, int) else list(eos)


def _until_end(ids: list[int], ends: list[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in ends:
            return ids[:i]
    return ids
