"""The caption node's preflight (the whole run's memory, issue 61): the captioner's peak on the device from its
folder's config.json and safetensors headers, no weight loaded, as tasks/run_memory.py counts a text encoder
(its Linears stored as caption.quantize says, caption.offload's layers on the host) plus what one image adds:
its vision tokens in the language model's forward and KV cache (prompt + image + caption.max_new_tokens), and
the vision tower's forward over the image's patches. The node refuses a captioner over the budget
(train.memory_limit_gb, else the device's free memory) before loading it, naming settings that fit."""
from __future__ import annotations

import json
from pathlib import Path

from tasks.captioning import CaptionError

PROMPT_TOKENS = 96  # the chat template and a prompt of a few sentences
KEEP = ("lm_head",)  # never stored quantized (text_load.TextLoading.keep): transformers' quantizers skip it too


def vision_patches(folder: Path, max_pixels: int | None) -> tuple[int, int]:
    """(patches the vision tower runs on, tokens the language model sees) for the largest image the image
    processor lets through (its max_pixels, or caption.max_pixels)."""
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    size = pre.get("size") or {}
    own = pre.get("max_pixels") or size.get("longest_edge") or 12845056
    pixels = min(max_pixels, own) if max_pixels else own
    patch, merge = pre.get("patch_size", 14), pre.get("merge_size", 2)
    patches = max(1, pixels // (patch * patch))
    return patches, max(1, patches // (merge * merge))


MAX_BATCH = 16  # caption.batch_size=0: the largest batch up to this that the preflight fits


def estimate(folder: Path, dtype: str, quantize: str, offload: bool, max_new_tokens: int,
             max_pixels: int | None, batch: int = 1) -> dict:
    """{device_gb, host_gb, setting, weights_gb, activations_gb} of the captioner captioning `batch` images at a
    time (the forward's states, KV cache and vision tower's activations grow with the batch; the weights do not)."""
    from tasks.run_memory import text_encoder
    from tasks.training.host_memory import PROCESS_GB
    from tasks.training.memory import GB

    patches, tokens = vision_patches(folder, max_pixels)
    part = text_encoder(folder, dtype, quantize, offload, PROMPT_TOKENS + tokens + max_new_tokens, KEEP)
    vision = json.loads((folder / "config.json").read_text()).get("vision_config") or {}
    width = vision.get("hidden_size", 1280)
    inter = vision.get("intermediate_size", 4 * width)
    act = 4 if dtype == "float32" else 2
    tower = patches * (4 * width + 3 * inter) * act  # one block's live states: no attention matrix (SDPA)
    peak = batch * max(part["activations"], tower) + part["transient"]
    setting = f"caption.quantize={quantize}" + (" caption.offload=true" if offload else "") + \
        (f" caption.max_pixels={max_pixels}" if max_pixels else "")
    # as run_memory's nodes: the process, what waits on the host and the loading's largest tensor in host RAM
    return {"device_gb": (part["weights"] + peak) / GB, "batch": batch, "host_gb": PROCESS_GB + (part["held"] + part["loading"]) / GB,
            "host_held_gb": part["held"] / GB, "setting": setting, "weights_gb": part["weights"] / GB,
            "activations_gb": peak / GB}


def check(cfg, folder: Path) -> dict:
    """The estimate at the config's settings; CaptionError when it is over the budget, naming what fits."""
    from tasks.training.memory import available_gb

    c = cfg.caption
    dtype = c.dtype or cfg.model.dtype
    est = estimate(folder, dtype, c.quantize, c.offload, c.max_new_tokens, c.max_pixels, max(c.batch_size, 1))
    limit = cfg.train.memory_limit_gb
    budget, source = (limit, "train.memory_limit_gb") if limit else available_gb()
    est["budget_gb"] = None if budget == float("inf") else budget
    if est["device_gb"] <= budget:
        if c.batch_size == 0:  # as the card allows: the largest batch whose preflight fits
            for b in range(MAX_BATCH, 1, -1):
                bigger = estimate(folder, dtype, c.quantize, c.offload, c.max_new_tokens, c.max_pixels, b)
                if bigger["device_gb"] <= budget:
                    return {**bigger, "budget_gb": est["budget_gb"]}
        return est
    fits = []
    pixels = c.max_pixels or vision_patches(folder, None)[0] * 196
    for quantize in ("none", "fp8", "int8", "nf4"):
        for offload in (False, True):
            for px in (c.max_pixels, min(pixels, 1024 * 1024), min(pixels, 512 * 512)):
                e = estimate(folder, dtype, quantize, offload, c.max_new_tokens, px)
                if e["device_gb"] <= budget and e["setting"] not in (f[0] for f in fits):
                    fits.append((e["setting"], e["device_gb"]))
    hint = ("would fit: " + "; ".join(f"{s} ({g:.2f} GiB)" for s, g in fits[:3])) if fits else \
        "nothing in caption.quantize, caption.offload, caption.max_pixels makes it fit: a smaller caption.model, " \
        "a bigger device, or caption.endpoint (a server elsewhere)"
    raise CaptionError(f"caption.model={c.model}: the captioner needs about {est['device_gb']:.2f} GiB "
                       f"({est['setting']}) > {budget:.2f} GiB ({source}); {hint}")
