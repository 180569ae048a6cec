"""Memory of the big bases with `model.quantize` and `train.blocks_to_swap`: rows `<model>:<options>` of
`python -m bench.memory` (contract), FLUX.1-dev, Qwen-Image (20.4 B) and FLUX.2 [dev] (32.2 B) at their real
configs, 1024x1024, 512 text tokens, rank 16 on each family's default targets, AdamW, bf16 autocast; and Wan 2.1
14B (`wan14b`) at its model card's 480x832, 81 frames (21 latent frames: 32,760 video tokens); LTX-2 (`ltx2`, its
video stream; the audio stream one token, as tasks/models/ltx2.py trains) at 768x512, 121 and 49 frames.

    python -m bench.memory --families [--only qwenimage:nf4+ckpt,...]

Options: `bf16` | `fp8` | `int8` | `nf4` (the base as stored), `+ckpt` (gradient checkpointing), `+offload`
(train.gradient_checkpointing_offload: the checkpointed inputs in host memory), `+swapN` (train.blocks_to_swap=N),
`+fsdpN` (train.shard=fsdp over N processes, per process; `+shardoffload`: train.shard_offload; bench/memory_shard.py).
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
  (each pack its own host copy, as on a GPU), held in host memory."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from bench.family_models import (GEOMETRY, batch_inputs, declared, geometry, model_table, parse,  # noqa: F401
                                  quantized_bytes, random_adapter, train_config, weights)

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
# The rows: each full-size model the families declare (tasks/models/bases/real_size.py), with the options of its rows:
# FLUX.1-dev, Qwen-Image, FLUX.2 [dev], Wan 2.1 14B (one Wan 2.2 A14B expert's shapes), LTX-2, the image-to-video
# models at their model cards' sizes and the shorter clips the smaller cards take, the 2026 families. The sharded
# +fsdpN rows: python -m bench.memory_shard (derived from these).
ROWS = tuple(f"{name}:{o}" for name, (_, rs) in declared().items() for o in rs.rows)


def activations(model: str, ckpt: bool, resolution: int, text_len: int, rank: int, offload: bool = False) -> dict:
    """LoRA parameters, their gradients' bytes and the activations of one bf16 step (fake tensors); with
    `offload`, what save_on_cpu takes to the host ("host_bytes") is not among what the graph keeps."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.fake_step import count_step, to_fake
    from tasks.training.train_setup import prepare_denoiser

    adapter, _, _ = random_adapter(model, torch.device("meta"))
    den, named = prepare_denoiser(adapter, train_config({"store": "bf16", "ckpt": ckpt, "swap": 0, "offload": offload}, text_len, rank))
    den.train()
    scheduler = FlowMatchEulerDiscreteScheduler()  # real tensors: made outside the fake mode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = to_fake(den, list(named.values()), mode)
    with mode, _host_counted() as host:
        latents, text = batch_inputs(model, dict(den.config), resolution, text_len)
        grads, saved, recompute = count_step(adapter, den, params, latents, text, scheduler)
        out = {"lora_params": sum(p.numel() for p in params), "lora_grad_bytes": grads,
               "activation_bytes": saved + recompute, "host_bytes": sum(host.values())}
    return out


@contextlib.contextmanager
def _host_counted():
    """{pack: bytes} of what activation_offload's save_on_cpu packs while the context is open: on a GPU each pack is
    its own host copy (torch.empty of the tensor's size, then copy_), also of a storage every block takes as an
    input (Wan's caption states, TI2V-5B's per-token timestep embedding), so each pack counts."""
    from tasks.training import activation_offload

    original, seen = activation_offload.save_on_cpu, {}

    class Counting(original):
        def __init__(self, pin_memory=False):
            super().__init__(pin_memory)
            pack = self.pack_hook

            def counted(t):
                seen[len(seen)] = t.numel() * t.element_size()
                return pack(t)
            self.pack_hook = counted

    activation_offload.save_on_cpu = Counting
    try:
        yield seen
    finally:
        activation_offload.save_on_cpu = original


def _headers(model: str, folder: Path) -> Path:
    import torch

    from bench.fake_step import model_headers

    adapter, _, _ = random_adapter(model, torch.device("meta"))
    return model_headers(adapter.load_denoiser(), folder / model)


def preflight(name: str, folder: Path, resolution: int = 1024, text_len: int = 512, rank: int = 16) -> dict:
    """tasks.training.memory.estimate for a row's settings, as the validate node computes it."""
    import torch

    from tasks.training.memory import estimate, family_factors, lora_targets

    model, options = name.split(":")
    adapter, cls, _ = random_adapter(model, torch.device("meta"))
    size, frames = geometry(model, resolution)
    cfg = train_config(parse(options), text_len, rank, frames)
    return estimate(cfg, _headers(model, folder), "transformer", lora_targets(cfg.train, adapter),
                    size, text_len, cls, adapter.swap_blocks, geometry=adapter.activation_geometry,
                    factors=family_factors(adapter))


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
            "resolution": resolution, "size": list(geometry(model, resolution)[0]), "frames": geometry(model, resolution)[1],
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
        quantized_bytes.cache_clear()
    return out


# GiB: the goal some train row of each model is meant to meet (issue 41's for FLUX.1-dev, Qwen-Image, FLUX.2, Wan 14B)
GOALS = {name: rs.train_goal_gib for name, (_, rs) in declared().items() if rs.train_goal_gib}
CARDS = (12, 16, 24, 48, 80)  # GB on the box
MARGIN_GIB = 1.0  # what max_memory_allocated leaves out: the CUDA context (~0.5 GiB), allocator fragmentation
LADDER = ("bf16", "bf16+ckpt", "fp8+ckpt", "int8+ckpt", "nf4+ckpt", "nf4+ckpt+offload")  # the least change first
# The card table's rows: (key in `cards`, model, denoisers held), as each model declares them (RealSize.card_rows).
# Wan 2.2 I2V-A14B: one expert trained (model.expert=high|low), and one LoRA on both (model.expert=both: both experts'
# weights, one set of activations)
CARD_ROWS = tuple(r for _, rs in declared().values() for r in rs.card_rows())


def advice(model: str, folder: Path, card_gb: int, resolution: int = 1024, text_len: int = 512, rank: int = 16,
           copies: int = 1) -> str:
    """The first setting whose preflight estimate leaves MARGIN_GIB free on a card of `card_gb` GB (1e9 bytes:
    cards are sold in GB): the ladder, then NF4 with the checkpointed inputs on the host and the fewest blocks
    swapped. `copies=2`: Wan 2.2's model.expert=both (both experts resident; swap counts over both)."""
    import torch

    from tasks.training.memory import block_order, estimate, family_factors, lora_targets, header_shapes

    adapter, cls, _ = random_adapter(model, torch.device("meta"))
    head = _headers(model, folder)
    budget = card_gb * 1e9 / GIB - MARGIN_GIB

    size, frames = geometry(model, resolution)

    def total(options):
        cfg = train_config(parse(options), text_len, rank, frames)
        return estimate(cfg, head, "transformer", lora_targets(cfg.train, adapter), size,
                        text_len, cls, adapter.swap_blocks, copies, geometry=adapter.activation_geometry,
                        factors=family_factors(adapter))["total_gb"]

    n_blocks = copies * len(block_order(header_shapes(head / "transformer"), adapter.swap_blocks))
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


def main(out: Path, only: str | None, run_cards=None) -> int:
    """The rows (all, or `only`'s with a colon) merged by name into `out`'s configs; goals per model."""
    import tempfile

    names = [n for n in only.split(",") if n.count(":") == 1] if only else list(ROWS)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        new = rows(names, Path(tmp))
    doc = json.loads(out.read_text()) if out.exists() else {"configs": []}
    kept = [{"host_gib": 0.0, **r} for r in doc.get("configs", []) if r["name"] not in {n["name"] for n in new}]
    doc["configs"] = kept + new
    every = [r for r in doc["configs"] if r["name"].count(":") == 1 and "+fsdp" not in r["name"]]  # one card's train rows
    doc["family_goals"] = {m: {"limit_gib": g, "best": min((r for r in every if r["name"].startswith(m + ":")),
                                                           key=lambda r: r["measured_gib"], default={}).get("name"),
                               "meets": any(r["measured_gib"] <= g for r in every if r["name"].startswith(m + ":"))}
                           for m, g in GOALS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        # train's own setting per card (advice), and the whole run's (bench/memory_nodes.py: `cards`, issue 61)
        doc["train_cards"] = {key: {str(c): advice(m, Path(tmp), c, copies=n) for c in CARDS} for key, m, n in CARD_ROWS}
        if run_cards is not None:  # bench/memory.py hands bench/memory_nodes.py's (which imports this module)
            doc["cards"], doc["run_cards"] = run_cards(Path(tmp))
    doc["families_seconds"] = time.perf_counter() - t0
    out.write_text(json.dumps(doc, indent=1, default=list))
    cards = "\n".join(f"| {m} | " + " | ".join(a.values()) + " |" for m, a in doc["train_cards"].items())
    head = "| model | " + " | ".join(f"{c} GB" for c in CARDS) + " |\n" + "|---" * (len(CARDS) + 1) + "|\n"
    print("\n" + table(every) + "\n\n" + head + cards + f"\n\nwrote {out} in {doc['families_seconds']:.0f} s")
    return 0
