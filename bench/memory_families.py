"""Memory of the big bases with `model.quantize` and `train.blocks_to_swap`: rows `<model>:<options>` of
`python -m bench.memory` (contract), FLUX.1-dev, Qwen-Image (20.4 B) and FLUX.2 [dev] (32.2 B) at their real
configs, 1024x1024, 512 text tokens, rank 16 on each family's default targets, AdamW, bf16 autocast; and Wan 2.1
14B (`wan14b`) at its model card's 480x832, 81 frames (21 latent frames: 32,760 video tokens); LTX-2 (`ltx2`, its
video stream; the audio stream one token, as tasks/models/ltx2.py trains) at 768x512, 121 and 49 frames.

    python -m bench.memory --families [--only qwenimage:nf4+ckpt,...]

Options: `bf16` | `fp8` | `int8` | `nf4` (the base as stored), `+ckpt` (gradient checkpointing), `+offload`
(train.gradient_checkpointing_offload: the checkpointed inputs in host memory), `+swapN` (train.blocks_to_swap=N).
Per row:
- measured_gib: what the device holds during a step: the weights that stay (each quantized Linear's bytes
  are those of torchao's own tensor of that shape, quantized here from real random weights; the fp8 and bf16
  ones their element size), the largest swapped layer in flight in bf16, LoRA + gradients + AdamW, and the
  activations of a real forward and backward of the whole model at this width and these token counts, seen
  through saved_tensors_hooks under FakeTensorMode (bench/memory.py's method; activations do not depend on
  how the base is stored: every storage path saves its weight, a parameter, not an activation).
- peak_gib: the peak of live tensor bytes over the whole step (forward, backward, clipping, AdamW), what a GPU's
  max_memory_allocated shows (bench/memory_peak.py), with what was live then (peak_breakdown_gib).
- preflight_gib: tasks.training.memory.estimate for the same settings, as the validate node computes it.
- host_gib: the swapped blocks' stored weights and, with +offload, the checkpointed inputs save_on_cpu took
  (distinct storages, counted as it packs them), held in host memory."""
from __future__ import annotations

import contextlib
import functools
import json
import re
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
ROWS = ("flux_dev:bf16+ckpt", "flux_dev:nf4+ckpt", "flux_dev:nf4+ckpt+offload+swap20", "flux_dev:int8+ckpt", "flux_dev:int8+ckpt+swap10",
        "qwenimage:bf16+ckpt", "qwenimage:int8+ckpt", "qwenimage:int8+ckpt+swap20", "qwenimage:nf4+ckpt",
        "flux2_dev:int8+ckpt+swap32", "flux2_dev:nf4+ckpt", "flux2_dev:nf4+ckpt+swap16", "flux2_dev:nf4+ckpt+offload+swap8",
        "wan14b:int8+ckpt", "wan14b:nf4+ckpt", "wan14b:int8+ckpt+swap20", "wan14b_81f:nf4+ckpt",
        "wan14b_81f:nf4+ckpt+swap30", "wan14b_81f:nf4+ckpt+offload", "wan14b_81f:int8+ckpt+offload",
        "wan14b_81f:nf4+ckpt+offload+swap11",
        "ltx2:bf16", "ltx2:bf16+ckpt", "ltx2:nf4+ckpt", "ltx2:nf4+ckpt+offload", "ltx2_49f:bf16", "ltx2_49f:bf16+ckpt")
# A model's training geometry where it is not the rows' square resolution: (width, height), frames. Wan 14B at
# 480x832: 33 frames (9 latent frames, 14,040 tokens) fit a 24 GB card; the model card's 81 (21, 32,760) do not
GEOMETRY = {"wan14b": ((832, 480), 33), "wan14b_81f": ((832, 480), 81), "ltx2": ((768, 512), 121),
            "ltx2_49f": ((768, 512), 49)}


def _size(model: str, resolution: int) -> tuple[tuple[int, int], int]:
    return GEOMETRY.get(model, ((resolution, resolution), 1))


def _models() -> dict:
    from bench.gpu import FLUX_DEV

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


def _adapter(model: str, device):
    import importlib

    import diffusers
    import torch

    ref, cls_name, arch = _models()[model]
    module, name = ref.split(":")
    base = getattr(importlib.import_module(module), name)
    cls = getattr(diffusers, cls_name)

    class Random(base):
        def load_denoiser(self):  # random bf16 weights on `device` (meta: shapes only); no file
            previous = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device(device):
                    return cls(**arch)
            finally:
                torch.set_default_dtype(previous)

    return Random(HERE, "bfloat16"), cls, arch


def _inputs(model: str, config: dict, resolution: int, text_len: int):
    import torch

    def z(*shape):
        return torch.zeros(*shape, dtype=torch.bfloat16)

    if model == "flux_dev":
        from bench.gpu import inputs

        return inputs(config, resolution, text_len, 1, torch.device("cpu"))
    if model.startswith("ltx2"):  # 128-channel latents (/8 in time, /32 in space); the connectors' video and audio text
        (w, h), frames = _size(model, resolution)
        return z(1, 128, 1 + (frames - 1) // 8, h // 32, w // 32), {
            "prompt_embeds": z(1, text_len, config["caption_channels"]),
            "audio_prompt_embeds": z(1, text_len, config["caption_channels"]),
            "attention_mask": torch.ones(1, text_len, dtype=torch.int64)}
    if model.startswith("wan14b"):  # 16-channel latents of the video VAE (/4 in time, /8 in space); UMT5 states
        (w, h), frames = _size(model, resolution)
        return z(1, 16, 1 + (frames - 1) // 4, h // 8, w // 8), {"prompt_embeds": z(1, text_len, config["text_dim"])}
    if model == "qwenimage":  # 16-channel /8 latents, packed 2x2 by the adapter; Qwen2.5-VL states and mask
        return z(1, 16, resolution // 8, resolution // 8), {
            "prompt_embeds": z(1, text_len, config["joint_attention_dim"]),
            "attention_mask": torch.ones(1, text_len, dtype=torch.int64)}
    # FLUX.2: the VAE's 32 channels patchified 2x2 (128 at /16); Mistral's three stacked states
    return z(1, config["in_channels"], resolution // 16, resolution // 16), {
        "prompt_embeds": z(1, text_len, config["joint_attention_dim"])}


def _cfg(opts: dict, text_len: int, rank: int, frames: int = 1) -> dict:
    store = opts["store"]
    return {"data": {"frames": frames}, "model": {"dtype": "bfloat16", "storage_dtype": None, "storage_modulation": False,
                      "quantize": store if store in ("fp8", "int8", "nf4") else "none", "max_sequence_length": text_len},
            "train": {"rank": rank, "alpha": None, "target_modules": None, "batch_size": 1, "optimizer": "adamw",
                      "mixed_precision": "bf16", "gradient_checkpointing": opts["ckpt"], "blocks_to_swap": opts["swap"],
                      "gradient_checkpointing_offload": opts.get("offload", False)}}


def activations(model: str, ckpt: bool, resolution: int, text_len: int, rank: int, offload: bool = False) -> dict:
    """LoRA parameters, their gradients' bytes and the activations of one bf16 step (fake tensors); with
    `offload`, what save_on_cpu takes to the host ("host_bytes") is not among what the graph keeps."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.memory import _to_fake, count_step
    from tasks.training.train_setup import prepare_denoiser

    adapter, _, _ = _adapter(model, torch.device("meta"))
    den, named = prepare_denoiser(adapter, _cfg({"store": "bf16", "ckpt": ckpt, "swap": 0, "offload": offload}, text_len, rank))
    den.train()
    scheduler = FlowMatchEulerDiscreteScheduler()  # real tensors: made outside the fake mode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = _to_fake(den, list(named.values()), mode)
    with mode, _host_counted() as host:
        latents, text = _inputs(model, dict(den.config), resolution, text_len)
        grads, saved, recompute = count_step(adapter, den, params, latents, text, scheduler)
        out = {"lora_params": sum(p.numel() for p in params), "lora_grad_bytes": grads,
               "activation_bytes": saved + recompute, "host_bytes": sum(host.values())}
    return out


@contextlib.contextmanager
def _host_counted():
    """{storage: bytes} of what offload_checkpoint's save_on_cpu packs while the context is open."""
    from tasks.training import offload_checkpoint

    original, seen = offload_checkpoint.save_on_cpu, {}

    class Counting(original):
        def __init__(self, pin_memory=False):
            super().__init__(pin_memory)
            pack = self.pack_hook

            def counted(t):
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
                return pack(t)
            self.pack_hook = counted

    offload_checkpoint.save_on_cpu = Counting
    try:
        yield seen
    finally:
        offload_checkpoint.save_on_cpu = original


@functools.lru_cache(maxsize=64)
def _stored_bytes(shape: tuple, store: str) -> int:
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

    adapter, cls, _ = _adapter(model, torch.device("meta"))
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
                    size = _stored_bytes(tuple(p.shape), store)
                elif store == "fp8":
                    size = p.numel()
            if name == "weight" and isinstance(module, CASTABLE) and id(module) in swapped:
                host += size
                in_flight = max(in_flight, p.numel() * 2)
            else:
                device += size
    return {"device": device + in_flight, "host": host, "in_flight": in_flight}


def _headers(model: str, folder: Path) -> Path:
    import torch

    from bench.memory import model_headers

    adapter, _, _ = _adapter(model, torch.device("meta"))
    return model_headers(adapter.load_denoiser(), folder / model)


def preflight(name: str, folder: Path, resolution: int = 1024, text_len: int = 512, rank: int = 16) -> dict:
    """tasks.training.memory.estimate for a row's settings, as the validate node computes it."""
    import torch

    from tasks.training.memory import estimate, lora_targets

    model, options = name.split(":")
    adapter, cls, _ = _adapter(model, torch.device("meta"))
    size, frames = _size(model, resolution)
    cfg = _cfg(parse(options), text_len, rank, frames)
    return estimate(cfg, _headers(model, folder), "transformer", lora_targets(cfg["train"], adapter),
                    size, text_len, cls, adapter.swap_blocks)


def row(name: str, folder: Path, resolution: int = 1024, text_len: int = 512, rank: int = 16,
        acts: dict | None = None) -> dict:
    t0 = time.perf_counter()
    model, options = name.split(":")
    opts = parse(options)
    a = acts or activations(model, opts["ckpt"], resolution, text_len, rank, opts["offload"])
    w = weights(model, opts)
    lora_bytes = a["lora_params"] * (4 + 8) + a["lora_grad_bytes"]  # fp32 weights, AdamW's moments, grads
    measured = w["device"] + lora_bytes + a["activation_bytes"]
    est = preflight(name, folder, resolution, text_len, rank)
    from bench.memory_peak import breakdown, family_peak

    peak = family_peak(name, resolution, text_len, rank)  # live storages over the whole step (bench/memory_peak.py)
    return {"name": name, "measured_gib": measured / GIB, "preflight_gib": est["total_gb"],
            "peak_gib": peak["peak_bytes"] / GIB, "peak_phase": peak["phase"], "peak_op": peak["op"],
            "peak_breakdown_gib": breakdown(peak), "preflight_transient_gib": est["transient_gb"],
            "host_gib": (w["host"] + a.get("host_bytes", 0)) / GIB, "preflight_host_gib": est["host_gb"],
            "estimate_error": est["total_gb"] / (measured / GIB) - 1, "weights_gib": w["device"] / GIB,
            "preflight_weights_gib": est["weights_gb"], "activations_gib": a["activation_bytes"] / GIB,
            "preflight_activations_gib": est["activations_gb"], "lora_params": a["lora_params"],
            "resolution": resolution, "size": list(_size(model, resolution)[0]), "frames": _size(model, resolution)[1],
            "text_tokens": text_len, "rank": rank, "seconds": time.perf_counter() - t0}


def rows(names, folder: Path, **kw) -> list[dict]:
    """Each row, the activations measured once per (model, checkpointing)."""
    memo, out = {}, []
    for name in names:
        model, options = name.split(":")
        key = (model, parse(options)["ckpt"], parse(options)["offload"])
        if key not in memo:
            memo[key] = activations(model, key[1], kw.get("resolution", 1024), kw.get("text_len", 512), kw.get("rank", 16),
                                    key[2])
        out.append(row(name, folder, acts=memo[key], **kw))
        r = out[-1]
        print(f"  {name:<28} measured {r['measured_gib']:6.2f} GiB  peak {r['peak_gib']:6.2f} GiB  preflight {r['preflight_gib']:6.2f} GiB "
              f"({r['estimate_error'] * 100:+.1f} %)  host {r['host_gib']:5.2f} GiB  {r['seconds']:.1f} s", flush=True)
    with contextlib.suppress(Exception):
        _stored_bytes.cache_clear()
    return out


GOALS = {"flux_dev": 16, "qwenimage": 24, "flux2_dev": 24, "wan14b": 24}  # GiB: the goals for some row of each
CARDS = (12, 16, 24, 48, 80)  # GB on the box
MARGIN_GIB = 1.0  # what max_memory_allocated leaves out: the CUDA context (~0.5 GiB), allocator fragmentation
LADDER = ("bf16", "bf16+ckpt", "fp8+ckpt", "int8+ckpt", "nf4+ckpt", "nf4+ckpt+offload")  # the least change first


def advice(model: str, folder: Path, card_gb: int, resolution: int = 1024, text_len: int = 512, rank: int = 16) -> str:
    """The first setting whose preflight estimate leaves MARGIN_GIB free on a card of `card_gb` GB (1e9 bytes:
    cards are sold in GB): the ladder, then NF4 with the checkpointed inputs on the host and the fewest blocks
    swapped."""
    import torch

    from tasks.training.memory import block_order, estimate, lora_targets, _weights

    adapter, cls, _ = _adapter(model, torch.device("meta"))
    head = _headers(model, folder)
    budget = card_gb * 1e9 / GIB - MARGIN_GIB

    size, frames = _size(model, resolution)

    def total(options):
        cfg = _cfg(parse(options), text_len, rank, frames)
        return estimate(cfg, head, "transformer", lora_targets(cfg["train"], adapter), size,
                        text_len, cls, adapter.swap_blocks)["total_gb"]

    n_blocks = len(block_order(_weights(head / "transformer"), adapter.swap_blocks))
    for options in [*LADDER, *(f"nf4+ckpt+offload+swap{n}" for n in range(1, n_blocks + 1))]:
        if (gb := total(options)) <= budget:
            return f"{options} ({gb:.1f} GiB)"
    return "does not fit"


def table(rows_: list[dict]) -> str:
    lines = ["| config | weights on the device | activations | measured | peak | preflight | host (swap) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows_:
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        lines.append(f"| {r['name']} | {r['weights_gib']:.2f} | {r['activations_gib']:.2f} | {r['measured_gib']:.2f} | "
                     f"{peak} | {r['preflight_gib']:.2f} | {r['host_gib']:.2f} |")
    return "\n".join(lines)


def main(out: Path, only: str | None) -> int:
    """The rows (all, or `only`'s with a colon) merged by name into `out`'s configs; goals per model."""
    import tempfile

    names = [n for n in only.split(",") if ":" in n] if only else list(ROWS)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        new = rows(names, Path(tmp))
    doc = json.loads(out.read_text()) if out.exists() else {"configs": []}
    kept = [{"host_gib": 0.0, **r} for r in doc.get("configs", []) if r["name"] not in {n["name"] for n in new}]
    doc["configs"] = kept + new
    every = [r for r in doc["configs"] if ":" in r["name"]]
    doc["family_goals"] = {m: {"limit_gib": g, "best": min((r for r in every if r["name"].startswith(m + ":")),
                                                           key=lambda r: r["measured_gib"], default={}).get("name"),
                               "meets": any(r["measured_gib"] <= g for r in every if r["name"].startswith(m + ":"))}
                           for m, g in GOALS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        doc["cards"] = {m: {str(c): advice(m, Path(tmp), c) for c in CARDS} for m in (*GOALS, "wan14b_81f", "ltx2")}
    doc["families_seconds"] = time.perf_counter() - t0
    out.write_text(json.dumps(doc, indent=1, default=list))
    cards = "\n".join(f"| {m} | " + " | ".join(a.values()) + " |" for m, a in doc["cards"].items())
    head = "| model | " + " | ".join(f"{c} GB" for c in CARDS) + " |\n" + "|---" * (len(CARDS) + 1) + "|\n"
    print("\n" + table(every) + "\n\n" + head + cards + f"\n\nwrote {out} in {doc['families_seconds']:.0f} s")
    return 0
