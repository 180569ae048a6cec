"""The big bases of bench.memory's family rows (`<model>:<options>`): each model's adapter with random weights at
its real architecture (random_adapter), its training geometry and one batch of cached inputs (batch_inputs), the
train config of a row's options (parse, train_config) and the bytes its base weights take as stored (weights).
Shared by bench.memory_families and bench.memory_peak; imports neither."""
from __future__ import annotations

import functools
import re
from pathlib import Path

from bench.flux_train import random_model
from tasks.config import Config, config_of

HERE = Path(__file__).resolve().parent
# A model's training geometry where it is not the rows' square resolution: (width, height), frames. Wan 14B at
# 480x832: 33 frames (9 latent frames, 14,040 tokens) fit a 24 GB card; the model card's 81 (21, 32,760) do not
GEOMETRY = {"wan14b": ((832, 480), 33), "wan14b_81f": ((832, 480), 81), "ltx2": ((768, 512), 121),
            "ltx2_49f": ((768, 512), 49)}
def geometry(model: str, resolution: int) -> tuple[tuple[int, int], int]:
    return GEOMETRY.get(model, ((resolution, resolution), 1))


def model_table() -> dict:
    from bench.flux_train import FLUX_DEV

    # (adapter, denoiser class, config): the class defaults are Qwen/Qwen-Image's and FLUX.2-dev's configs
    return {"flux_dev": ("tasks.models.flux:FluxAdapter", "FluxTransformer2DModel", FLUX_DEV),
            "qwenimage": ("tasks.models.qwenimage:QwenImageAdapter", "QwenImageTransformer2DModel", {}),
            "flux2_dev": ("tasks.models.flux2_dev:Flux2DevAdapter", "Flux2Transformer2DModel", {}),
            # WanTransformer3DModel's defaults are Wan-AI/Wan2.1-T2V-14B's config (5120 wide, 40 blocks)
            "wan14b": ("tasks.models.wan:WanAdapter", "WanTransformer3DModel", {}),
            "wan14b_81f": ("tasks.models.wan:WanAdapter", "WanTransformer3DModel", {}),
            # LTX2VideoTransformer3DModel's defaults are Lightricks/LTX-2's (48 blocks, 4096 wide video stream)
            "ltx2": ("tasks.models.ltx2:LTX2Adapter", "LTX2VideoTransformer3DModel", {}),
            "ltx2_49f": ("tasks.models.ltx2:LTX2Adapter", "LTX2VideoTransformer3DModel", {})}


def parse(options: str) -> dict:
    parts = options.split("+")
    swap = next((int(p[4:]) for p in parts if re.fullmatch(r"swap\d+", p)), 0)
    return {"store": parts[0], "ckpt": "ckpt" in parts, "swap": swap, "offload": "offload" in parts}


def random_adapter(model: str, device):
    import importlib

    import diffusers

    ref, cls_name, arch = model_table()[model]
    module, name = ref.split(":")
    base = getattr(importlib.import_module(module), name)
    cls = getattr(diffusers, cls_name)

    class Random(base):
        def load_denoiser(self):  # random bf16 weights on `device` (meta: shapes only); no file
            return random_model(cls, arch, device)

    return Random(HERE, "bfloat16"), cls, arch


def batch_inputs(model: str, config: dict, resolution: int, text_len: int):
    import torch

    def z(*shape):
        return torch.zeros(*shape, dtype=torch.bfloat16)

    if model == "flux_dev":
        from bench.flux_train import inputs

        return inputs(config, resolution, text_len, 1, torch.device("cpu"))
    if model.startswith("ltx2"):  # 128-channel latents (/8 in time, /32 in space); the connectors' video and audio text
        (w, h), frames = geometry(model, resolution)
        return z(1, 128, 1 + (frames - 1) // 8, h // 32, w // 32), {
            "prompt_embeds": z(1, text_len, config["caption_channels"]),
            "audio_prompt_embeds": z(1, text_len, config["caption_channels"]),
            "attention_mask": torch.ones(1, text_len, dtype=torch.int64)}
    if model.startswith("wan14b"):  # 16-channel latents of the video VAE (/4 in time, /8 in space); UMT5 states
        (w, h), frames = geometry(model, resolution)
        return z(1, 16, 1 + (frames - 1) // 4, h // 8, w // 8), {"prompt_embeds": z(1, text_len, config["text_dim"])}
    if model == "qwenimage":  # 16-channel /8 latents, packed 2x2 by the adapter; Qwen2.5-VL states and mask
        return z(1, 16, resolution // 8, resolution // 8), {
            "prompt_embeds": z(1, text_len, config["joint_attention_dim"]),
            "attention_mask": torch.ones(1, text_len, dtype=torch.int64)}
    # FLUX.2: the VAE's 32 channels patchified 2x2 (128 at /16); Mistral's three stacked states
    return z(1, config["in_channels"], resolution // 16, resolution // 16), {
        "prompt_embeds": z(1, text_len, config["joint_attention_dim"])}


def train_config(opts: dict, text_len: int, rank: int, frames: int = 1) -> Config:
    store = opts["store"]
    return config_of({
        "data": {"frames": frames},
        "model": {"dtype": "bfloat16", "storage_dtype": None, "storage_modulation": False,
                  "quantize": store if store in ("fp8", "int8", "nf4") else "none", "max_sequence_length": text_len},
        "train": {"rank": rank, "alpha": None, "target_modules": None, "batch_size": 1, "optimizer": "adamw",
                  "mixed_precision": "bf16", "gradient_checkpointing": opts["ckpt"], "blocks_to_swap": opts["swap"],
                  "gradient_checkpointing_offload": opts.get("offload", False)}})


@functools.lru_cache(maxsize=64)
def quantized_bytes(shape: tuple, store: str) -> int:
    """Bytes of torchao's tensor for a bf16 weight of this shape (real random values, quantized here)."""
    import torch

    from tasks.training.block_swap import stored_nbytes
    from tasks.training.quantized_base import quantize_weight

    q = quantize_weight(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16), store)
    return stored_nbytes(q) if q is not None else 2 * torch.Size(shape).numel()


def weights(model: str, opts: dict) -> dict:
    """(device bytes, host bytes) of the base weights as training holds them with these options."""
    import torch

    from tasks.training.block_swap import blocks
    from tasks.training.fp8_base import CASTABLE, skipped
    from tasks.training.memory import layerwise_skip_patterns

    adapter, cls, _ = random_adapter(model, torch.device("meta"))
    den = adapter.load_denoiser()
    store, skip = opts["store"], layerwise_skip_patterns(cls, False)
    swapped = {id(m) for b in blocks(den, adapter.swap_blocks)[len(blocks(den, adapter.swap_blocks)) - opts["swap"]:]
               for m in b.modules()} if opts["swap"] else set()
    device = host = in_flight = 0
    for path, module in den.named_modules():
        for name, p in module.named_parameters(recurse=False):
            size = p.numel() * 2
            if name == "weight" and isinstance(module, CASTABLE) and not skipped(path, skip):
                if store in ("int8", "nf4") and isinstance(module, torch.nn.Linear):
                    size = quantized_bytes(tuple(p.shape), store)
                elif store == "fp8":
                    size = p.numel()
            if name == "weight" and isinstance(module, CASTABLE) and id(module) in swapped:
                host += size
                in_flight = max(in_flight, p.numel() * 2)
            else:
                device += size
    return {"device": device + in_flight, "host": host, "in_flight": in_flight}
