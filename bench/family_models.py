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
# 480x832: 33 frames (9 latent frames, 14,040 tokens) fit a 24 GB card; the model card's 81 (21, 32,760) do not.
# The image-to-video models at their model cards' sizes: Wan 2.1 I2V-14B (480P) and Wan 2.2 I2V-A14B at 480x832, 81
# frames (32,760 tokens, as wan14b_81f); Wan 2.2 TI2V-5B at 704x1280, 121 frames (its /16 VAE: 31 x 22 x 40 = 27,280)
GEOMETRY = {"wan14b": ((832, 480), 33), "wan14b_81f": ((832, 480), 81), "ltx2": ((768, 512), 121),
            "ltx2_49f": ((768, 512), 49), "wan21_i2v_14b": ((832, 480), 81), "wan22_i2v_a14b": ((832, 480), 81),
            "wan22_ti2v_5b": ((1280, 704), 121),
            # shorter clips, for the card table's smaller cards (nothing fits 12 GB at the model cards' lengths)
            "wan21_i2v_14b_33f": ((832, 480), 33), "wan22_i2v_a14b_33f": ((832, 480), 33),
            "wan22_ti2v_5b_49f": ((1280, 704), 49)}
# The image-to-video transformers' diffusers configs where they differ from WanTransformer3DModel's defaults (Wan 2.1
# T2V-14B's), as diffusers' scripts/convert_wan_to_diffusers.py writes them (`get_transformer_config`):
# "Wan-I2V-14B-480p": 36 input channels (16 noisy + 4 mask + 16 first-frame latent), the CLIP ViT-H image states
# (image_dim 1280) through their own key/value projections (added_kv_proj_dim 5120); "Wan2.2-I2V-14B-720p"
# (Wan-AI/Wan2.2-I2V-A14B, each expert): 36 input channels, no image states; "Wan2.2-TI2V-5B": 24 heads x 128 = 3072
# wide, ffn 14336, 30 blocks, 48 channels in and out (the Wan 2.2 VAE's z_dim; vae22_diffusers_config: base_dim 160,
# decoder_base_dim 256, is_residual, patch_size 2, scale_factor_spatial 16). The CLIP image encoder (CLIPVisionModel,
# laion/CLIP-ViT-H-14: 1280 wide, 32 layers, 257 tokens at 224 px) is not in the rows: its states are cached with
# each clip's condition (tasks/models/wan_i2v.py), so the train node never loads it.
WAN21_I2V_14B = {"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
WAN22_I2V_A14B = {"in_channels": 36}
WAN22_TI2V_5B = {"num_attention_heads": 24, "attention_head_dim": 128, "ffn_dim": 14336, "num_layers": 30,
                 "in_channels": 48, "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "patch_size": (1, 2, 2)}
CLIP_TOKENS = 257  # CLIP ViT-H/14 at 224 px: 16 x 16 patches + the class token (the penultimate layer's states)


def declared() -> dict:
    """{row prefix: (family, RealSize)} of every full-size model the registry's families declare (issue 64 item 4:
    a family's knowledge in its own files; tasks/models/bases/real_size.py)."""
    from tasks.models import FAMILIES, adapter_class

    return {rs.name: (f, rs) for f in FAMILIES for rs in adapter_class(f).real_sizes}


def geometry(model: str, resolution: int) -> tuple[tuple[int, int], int]:
    if model in declared():
        rs = declared()[model][1]
        return rs.size or (resolution, resolution), rs.frames
    return GEOMETRY.get(model, ((resolution, resolution), 1))


def model_table() -> dict:
    from bench.flux_train import FLUX_DEV
    from tasks.models import FAMILIES

    # (adapter, denoiser class, config): the class defaults are Qwen/Qwen-Image's and FLUX.2-dev's configs
    return {"flux_dev": ("tasks.models.flux:FluxAdapter", "FluxTransformer2DModel", FLUX_DEV),
            "qwenimage": ("tasks.models.qwenimage:QwenImageAdapter", "QwenImageTransformer2DModel", {}),
            "flux2_dev": ("tasks.models.flux2_dev:Flux2DevAdapter", "Flux2Transformer2DModel", {}),
            # WanTransformer3DModel's defaults are Wan-AI/Wan2.1-T2V-14B's config (5120 wide, 40 blocks)
            "wan14b": ("tasks.models.wan:WanAdapter", "WanTransformer3DModel", {}),
            "wan14b_81f": ("tasks.models.wan:WanAdapter", "WanTransformer3DModel", {}),
            # LTX2VideoTransformer3DModel's defaults are Lightricks/LTX-2's (48 blocks, 4096 wide video stream)
            "ltx2": ("tasks.models.ltx2:LTX2Adapter", "LTX2VideoTransformer3DModel", {}),
            "ltx2_49f": ("tasks.models.ltx2:LTX2Adapter", "LTX2VideoTransformer3DModel", {}),
            # image-to-video (tasks/models/wan_i2v.py, wan22_i2v.py, wan22_ti2v.py); Wan 2.2 I2V-A14B: one expert
            # (model.expert=high|low, the two have the same shapes), as the wan14b rows are one Wan 2.2 A14B expert
            **{name: (ref, "WanTransformer3DModel", arch) for names, ref, arch in (
                (("wan21_i2v_14b", "wan21_i2v_14b_33f"), "tasks.models.wan_i2v:WanI2VAdapter", WAN21_I2V_14B),
                (("wan22_i2v_a14b", "wan22_i2v_a14b_33f"), "tasks.models.wan22_i2v:Wan22I2VAdapter", WAN22_I2V_A14B),
                (("wan22_ti2v_5b", "wan22_ti2v_5b_49f"), "tasks.models.wan22_ti2v:Wan22TI2VAdapter", WAN22_TI2V_5B))
               for name in names},
            **{name: (FAMILIES[f][0], rs.denoiser, rs.arch) for name, (f, rs) in declared().items()}}


def parse(options: str) -> dict:
    parts = options.split("+")
    swap = next((int(p[4:]) for p in parts if re.fullmatch(r"swap\d+", p)), 0)
    # +fsdpN: train.shard=fsdp over N processes, batch N (one item each); +shardoffload: train.shard_offload (issue 63)
    shards = next((int(p[4:]) for p in parts if re.fullmatch(r"fsdp\d+", p)), 1)
    return {"store": parts[0], "ckpt": "ckpt" in parts, "swap": swap, "offload": "offload" in parts,
            "shards": shards, "shard_offload": "shardoffload" in parts}


def random_adapter(model: str, device):
    import importlib

    import diffusers

    ref, cls_name, arch = model_table()[model]
    module, name = ref.split(":")
    base = getattr(importlib.import_module(module), name)
    cls = getattr(diffusers, cls_name)

    class Random(base):
        # Wan 2.2's experts: the switch is read from model_index.json (there is none here), and an expert redraws a
        # timestep off its side (a data-dependent branch fake tensors cannot take); memory is the same on either side
        boundary = 900.0

        def _mine(self, t) -> bool:
            return True

        def load_denoiser(self):  # random bf16 weights on `device` (meta: shapes only); no file
            return random_model(cls, arch, device)

    return Random(HERE, "bfloat16"), cls, arch


def batch_inputs(model: str, config: dict, resolution: int, text_len: int):
    import torch

    def z(*shape):
        return torch.zeros(*shape, dtype=torch.bfloat16)

    if model in declared():  # the family's own shapes (FamilyAdapter.bench_batch)
        from tasks.models import adapter_class

        size, frames = geometry(model, resolution)
        return adapter_class(declared()[model][0]).bench_batch(config, size, frames, text_len)

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
    if model.startswith("wan22_ti2v_5b"):  # 48-channel latents of the Wan 2.2 VAE (/16); the condition: the first frame's latent
        (w, h), frames = geometry(model, resolution)
        c, f = config["in_channels"], 1 + (frames - 1) // 4
        return z(1, c, f, h // 16, w // 16), {"prompt_embeds": z(1, text_len, config["text_dim"]),
                                              "control_latents": z(1, 1, c, 1, h // 16, w // 16)}
    if model.startswith(("wan21_i2v_14b", "wan22_i2v_a14b")):  # the mask + first-frame latent condition (4 + 16 channels)
        (w, h), frames = geometry(model, resolution)
        f = 1 + (frames - 1) // 4
        text = {"prompt_embeds": z(1, text_len, config["text_dim"]), "control_latents": z(1, 1, 20, f, h // 8, w // 8)}
        if config.get("image_dim"):  # Wan 2.1: the first frame's CLIP states, cached with the condition
            text["control_image_embeds"] = z(1, 1, CLIP_TOKENS, config["image_dim"])
        return z(1, 16, f, h // 8, w // 8), text
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
                  "gradient_checkpointing_offload": opts.get("offload", False),
                  **({"shard": "fsdp", "num_processes": opts["shards"], "batch_size": opts["shards"],
                      "shard_offload": opts.get("shard_offload", False)} if opts.get("shards", 1) > 1 else {})}})


@functools.lru_cache(maxsize=64)
def quantized_bytes(shape: tuple, store: str) -> int:
    """Bytes of torchao's tensor for a bf16 weight of this shape (real random values, quantized here)."""
    import torch

    from tasks.training.block_swap import stored_nbytes
    from tasks.training.quantized_base import quantize_weight

    q = quantize_weight(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16), store)
    return stored_nbytes(q) if q is not None else 2 * torch.Size(shape).numel()


def stored_size(module, name: str, p, path: str, store: str, skip) -> int:
    """Bytes of one parameter as training stores it with `store` (bf16 | fp8 | int8 | nf4): torchao's own tensors' for
    a quantized Linear weight, one a value for fp8, else bf16's two."""
    import torch

    from tasks.training.fp8_base import CASTABLE, skipped

    if name == "weight" and isinstance(module, CASTABLE) and not skipped(path, skip):
        if store in ("int8", "nf4") and isinstance(module, torch.nn.Linear):
            return quantized_bytes(tuple(p.shape), store)
        if store == "fp8":
            return p.numel()
    return p.numel() * 2


def weights(model: str, opts: dict) -> dict:
    """(device bytes, host bytes) of the base weights as training holds them with these options."""
    import torch

    from tasks.training.block_swap import blocks
    from tasks.training.fp8_base import CASTABLE
    from tasks.training.memory import layerwise_skip_patterns

    adapter, cls, _ = random_adapter(model, torch.device("meta"))
    den = adapter.load_denoiser()
    store, skip = opts["store"], layerwise_skip_patterns(cls, False)
    swapped = {id(m) for b in blocks(den, adapter.swap_blocks)[len(blocks(den, adapter.swap_blocks)) - opts["swap"]:]
               for m in b.modules()} if opts["swap"] else set()
    device = host = in_flight = 0
    for path, module in den.named_modules():
        for name, p in module.named_parameters(recurse=False):
            size = stored_size(module, name, p, path, store, skip)
            if name == "weight" and isinstance(module, CASTABLE) and id(module) in swapped:
                host += size
                in_flight = max(in_flight, p.numel() * 2)
            else:
                device += size
    return {"device": device + in_flight, "host": host, "in_flight": in_flight}
