"""Sharded rows of `python -m bench.memory --families` (issue 63): `<model>:<options>+fsdp<N>`, one process of N with
train.shard=fsdp (`+shardoffload`: train.shard_offload=true), batch N (one item a process), per process; what a sharded
step moves between the GPUs and what that costs; the card table's multi-GPU columns.

    python -m bench.memory_shard [--out bench/memory.json] [--only flux2_dev:bf16+ckpt+fsdp2,...] [--no-cards]

Derived, not run sharded (no machine with several GPUs here; FSDP2 needs one process per GPU): each row starts from
the unsharded row of the same options (`base`: bench/memory.json's measured row, or measured now by
bench.memory_families.row where the JSON has none) and divides its measured pieces as tasks/training/sharding.py's
layout holds them (tasks/training/shard_memory.py, the same arithmetic as the preflight):
- weights: 1/N of the base as stored plus the largest block twice and the root unit whole, each unit's bytes counted
  from the module tree as bench.memory's weights are (torchao's own NF4 / int8 tensors' bytes; its LoRA's fp32
  weights and their gradients with it);
- LoRA + gradients + AdamW: the base row's, 1/N; activations: the base row's (one item, a process's share);
- peak_gib: the base row's live peak with its weights and LoRA states replaced alike (gradients in flight as measured);
- host_gib: the base row's (the activation offload's) plus, with +shardoffload, the shard and the LoRA's states;
  machine_host_gib the preflight's need of one machine running all N (loading one after another).
Communication per process and micro-batch (`comm`): the gathered bytes (every block in forward and again in backward,
the root once, each with its LoRA; a ring moves (N-1)/N of it into each process) and the LoRA's fp32 gradients
reduce-scattered ((N-1)/N), over LINKS: nominal per-direction bandwidths, an upper bound on speed (NCCL reaches
about 70-90 % of them; consumer cards without peer-to-peer go through host memory, slower). `compute_s`: the step's
matmuls (2 x params x tokens forward, again for the input gradients, again for the recompute with checkpointing) at
the bf16 rate this project's H200 measured on FLUX.1-dev (bench/gpu_speed.json): what the gathers can hide behind."""
from __future__ import annotations

import functools
import json
import re
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
# The rows, and those the card table's multi-GPU columns pick (SHARD_CARDS)
SHARD_ROWS = ("flux2_dev:bf16+ckpt+fsdp2", "flux2_dev:bf16+ckpt+fsdp4", "qwenimage:bf16+ckpt+fsdp2",
              "wan14b_81f:bf16+ckpt+fsdp2", "flux2_dev:nf4+ckpt+fsdp2",
              "flux2_dev:bf16+ckpt+shardoffload+fsdp2", "flux2_dev:bf16+ckpt+shardoffload+fsdp4",
              "flux_dev:bf16+ckpt+fsdp2", "flux_dev:bf16+ckpt+fsdp4",
              "qwenimage:bf16+ckpt+fsdp4", "qwenimage:bf16+ckpt+shardoffload+fsdp2",
              "wan14b:bf16+ckpt+fsdp2", "wan14b:bf16+ckpt+fsdp4", "wan14b:bf16+ckpt+shardoffload+fsdp2",
              "wan14b_81f:bf16+ckpt+offload+shardoffload+fsdp2", "wan14b_81f:bf16+ckpt+offload+shardoffload+fsdp4",
              "ltx2:bf16+ckpt+fsdp2", "ltx2:bf16+ckpt+fsdp4", "ltx2:bf16+ckpt+shardoffload+fsdp2",
              "wan21_i2v_14b:bf16+ckpt+offload+fsdp2", "wan21_i2v_14b:bf16+ckpt+offload+shardoffload+fsdp2",
              "wan21_i2v_14b:bf16+ckpt+offload+shardoffload+fsdp4",
              "wan21_i2v_14b_33f:bf16+ckpt+fsdp2", "wan21_i2v_14b_33f:bf16+ckpt+offload+fsdp4",
              "wan21_i2v_14b_33f:bf16+ckpt+shardoffload+fsdp2",
              "wan22_i2v_a14b:bf16+ckpt+fsdp2", "wan22_i2v_a14b:bf16+ckpt+offload+shardoffload+fsdp2",
              "wan22_i2v_a14b:bf16+ckpt+offload+shardoffload+fsdp4",
              "wan22_i2v_a14b_33f:bf16+ckpt+fsdp2", "wan22_i2v_a14b_33f:bf16+ckpt+fsdp4",
              "wan22_i2v_a14b_33f:bf16+ckpt+shardoffload+fsdp2",
              "wan22_ti2v_5b:bf16+ckpt+fsdp2", "wan22_ti2v_5b:bf16+ckpt+fsdp4", "wan22_ti2v_5b:bf16+ckpt+offload+fsdp2",
              "wan22_ti2v_5b_49f:bf16+ckpt+fsdp2", "wan22_ti2v_5b_49f:bf16+ckpt+fsdp4")
_BASES: dict = {}  # unsharded rows measured by this process (one per base, however many shard counts divide it)
# GB/s per direction, nominal: PCIe 4.0 x16 (16 GT/s x 16 lanes, 128b/130b: 31.5; ~25 achieved, the figure used),
# NVLink 3 on A100 SXM (600 GB/s total, 300 each way), NVLink 4 on H100 SXM (900 total, 450 each way); NVIDIA's
# A100 / H100 datasheets, PCI-SIG's PCIe 4.0 rate
LINKS = {"pcie4_x16": 25e9, "nvlink3_a100": 300e9, "nvlink4_h100": 450e9}
SHARD_CARDS = (("2x24", 2, 24), ("4x24", 4, 24), ("2x48", 2, 48))  # (column, GPUs, GB each)
# The sharded train ladder: the base kept in bf16 while an offload makes it fit (what sharding is for), then fp8, NF4
SHARD_LADDER = ("bf16", "bf16+ckpt", "bf16+ckpt+offload", "bf16+ckpt+shardoffload", "bf16+ckpt+offload+shardoffload",
                "fp8+ckpt", "nf4+ckpt", "nf4+ckpt+offload", "nf4+ckpt+shardoffload", "nf4+ckpt+offload+shardoffload")


def base_name(name: str) -> str:
    """The unsharded row a sharded one divides: the name without +fsdpN and +shardoffload."""
    model, options = name.split(":")
    return model + ":" + "+".join(p for p in options.split("+") if not re.fullmatch(r"fsdp\d+|shardoffload", p))


@functools.lru_cache(maxsize=4)
def unit_bytes(model: str, store: str, rank: int = 16) -> dict:
    """{blocks: each block's bytes as gathered, root: the root unit's, lora: LoRA parameters, loading: host bytes of
    the largest tensor read and cast (bf16 + fp32)} from the module tree: the weights as family_models.weights stores
    them (torchao's tensors' own bytes), each unit's LoRA fp32 weights and their gradients."""
    import torch

    from bench.family_models import random_adapter, stored_size, train_config
    from tasks.training.memory import layerwise_skip_patterns, lora_params, lora_targets
    from tasks.training.shard_memory import units

    adapter, cls, _ = random_adapter(model, torch.device("meta"))
    den = adapter.load_denoiser()
    skip = layerwise_skip_patterns(cls, False)
    per_weight, shapes = {}, {}
    for path, module in den.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{path}.{name}" if path else name
            per_weight[full], shapes[full] = stored_size(module, name, p, path, store, skip), list(p.shape)
    tc = train_config({"store": store, "ckpt": True, "swap": 0}, 512, rank).train
    targets = lora_targets(tc, adapter)
    blocks, root = units(shapes, per_weight, tuple(adapter.swap_blocks), lambda s: lora_params(s, targets, rank))
    largest = max(torch.Size(s).numel() for s in shapes.values())
    return {"blocks": blocks, "root": root, "lora": lora_params(shapes, targets, rank), "loading": largest * 6,
            "config": dict(den.config), "adapter": adapter}


def comm(allgather_bytes: float, reduce_bytes: float, h2d_bytes: float = 0.0) -> dict:
    """Seconds the bytes take over each link (per direction; the collectives overlap compute where they can)."""
    out = {"allgather_gb": allgather_bytes / 1e9, "reduce_scatter_gb": reduce_bytes / 1e9,
           **{f"{link}_s": (allgather_bytes + reduce_bytes) / bw for link, bw in LINKS.items()}}
    if h2d_bytes:  # +shardoffload: each gathered shard first comes from host memory, over PCIe
        out.update(h2d_gb=h2d_bytes / 1e9, h2d_pcie4_s=h2d_bytes / LINKS["pcie4_x16"])
    return out


def h200_rate() -> float | None:
    """FLOP/s of the bf16 FLUX.1-dev step bench/gpu_speed.json measured (None where the file has none)."""
    try:
        s = next(x for x in json.loads((HERE / "gpu_speed.json").read_text())["settings"] if x["name"] == "bf16")
        return s["flops"] / s["step_median_s"]
    except (OSError, StopIteration, KeyError, ValueError):
        return None


def row(name: str, folder: Path, resolution: int = 1024, text_len: int = 512, rank: int = 16,
        measured: dict | None = None) -> dict:
    """A sharded row, derived (module doc). `measured`: bench/memory.json's rows by name (else read)."""
    from bench.family_models import geometry, parse, train_config
    from bench.memory_families import preflight, row as unsharded_row
    from tasks.training.memory import GB
    from tasks.training.shard_memory import machine_host

    t0 = time.perf_counter()
    model, options = name.split(":")
    opts = parse(options)
    n, off = opts["shards"], opts["shard_offload"]
    rows = measured if measured is not None else {r["name"]: r for r in json.loads(
        (HERE / "memory.json").read_text()).get("configs", [])}
    base, source = rows.get(base_name(name)), "bench/memory.json"
    if base is None:  # measured now, unsharded, by bench.memory's own method
        if base_name(name) not in _BASES:
            _BASES[base_name(name)] = unsharded_row(base_name(name), folder, resolution, text_len, rank)
        base, source = _BASES[base_name(name)], "measured by this run (bench.memory_families.row)"
    u = unit_bytes(model, opts["store"], rank)
    blocks, root, lora = u["blocks"], u["root"], u["lora"]
    whole = base["weights_gib"] * GIB  # the module tree's bytes, as the base row measured them
    gathered = 2 * max(blocks) + root
    lora_part = (base["measured_gib"] - base["weights_gib"] - base["activations_gib"]) * GIB  # LoRA, grads, AdamW
    kept = 0.0 if off else lora_part / n
    weights = gathered if off else whole / n + gathered
    states = lora * (4 + 8)  # LoRA weights and AdamW moments in the base row's peak
    held = base["measured_gib"] * GIB - whole + weights - lora_part + kept
    peak = base["peak_gib"] * GIB - whole + weights - states * (1 if off else 1 - 1 / n)
    host = base["host_gib"] * GIB + ((whole / n + lora_part / n) if off else 0.0)
    est = preflight(name, folder, resolution, text_len, rank)
    size, frames = geometry(model, resolution)
    moved = (n - 1) / n
    tokens = u["adapter"].activation_geometry(u["config"], size, text_len, frames)[0]
    flop = (6 if opts["ckpt"] else 4) * est["params"] * tokens
    rate = h200_rate()
    return {"name": name, "derived": True, "derived_from": base["name"], "base_source": source, "shards": n,
            "shard_offload": off, "batch_size": n, "measured_gib": held / GIB, "preflight_gib": est["total_gb"],
            "peak_gib": peak / GIB, "estimate_error": est["total_gb"] / (held / GIB) - 1,
            "host_gib": host / GIB, "preflight_host_gib": est["host_gb"],
            "machine_host_gib": machine_host(train_config(opts, text_len, rank, frames), est, u["loading"] / GB)[
                "host_need_gb"],
            "weights_gib": weights / GIB, "preflight_weights_gib": est["weights_gb"], "shard_gib": whole / n / GIB,
            "gathered_gib": gathered / GIB, "largest_unit_gib": max(blocks) / GIB, "root_unit_gib": root / GIB,
            "preflight_gathered_gib": est["gathered_gb"], "units": len(blocks) + 1,
            "activations_gib": base["activations_gib"], "preflight_activations_gib": est["activations_gb"],
            "lora_params": lora, "unsharded_measured_gib": base["measured_gib"], "unsharded_peak_gib": base["peak_gib"],
            "unsharded_weights_gib": base["weights_gib"], "unsharded_host_gib": base["host_gib"],
            "comm": {**comm((2 * sum(blocks) + root) * moved, lora * 4 * moved, (2 * sum(blocks) + root) / n if off else 0.0),
                     "step_tflop": flop / 1e12, **({"compute_s": flop / rate} if rate else {}),
                     "preflight_allgather_gb": est["allgather_gb"] * GB / 1e9},
            "resolution": resolution, "size": list(size), "frames": frames, "text_tokens": text_len, "rank": rank,
            "seconds": time.perf_counter() - t0}


def shard_cards(root: Path, keys=None) -> tuple[dict, dict]:
    """(`shard_cards`, `shard_run_cards`) in bench/memory.json: per card-table row and SHARD_CARDS column, the whole run
    with the train node sharded over the column's GPUs (SHARD_LADDER, each +fsdpN) and the other nodes on one of its
    cards, as bench.memory_nodes.run_advice picks them."""
    from bench.memory_families import CARD_ROWS
    from bench.memory_nodes import card_text, run_advice

    full = {}
    for key, model, copies in CARD_ROWS:
        if keys is not None and key not in keys:
            continue
        full[key] = {label: ({"setting": None, "stuck": "train: model.expert=both does not shard"} if copies > 1 else
                             run_advice(model, root, gb, ladder=[_sharded(o, n) for o in SHARD_LADDER]))
                     for label, n, gb in SHARD_CARDS}
    return {k: {c: card_text(a) for c, a in v.items()} for k, v in full.items()}, full


def _sharded(options: str, n: int) -> str:
    parts = options.split("+")
    return "+".join([p for p in parts if p != "shardoffload"] + (["shardoffload"] if "shardoffload" in parts else [])
                    + [f"fsdp{n}"])


def table(rows: list[dict]) -> str:
    head = ("| row | per GPU: preflight / derived peak GiB | shard + gathered GiB | host GiB (a process / the machine) "
            "| gathered + reduced GB a step | PCIe 4 s | NVLink 3 s | NVLink 4 s | step compute s |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        c = r["comm"]
        h2d = f" (+{c['h2d_pcie4_s']:.1f} host->GPU)" if "h2d_pcie4_s" in c else ""
        lines.append(f"| {r['name']} | {r['preflight_gib']:.1f} / {r['peak_gib']:.1f} | {r['shard_gib']:.1f} + "
                     f"{r['gathered_gib']:.1f} | {r['host_gib']:.1f} / {r['machine_host_gib']:.1f} | "
                     f"{c['allgather_gb']:.1f} + {c['reduce_scatter_gb']:.2f} | {c['pcie4_x16_s']:.2f}{h2d} | "
                     f"{c['nvlink3_a100_s']:.2f} | {c['nvlink4_h100_s']:.2f} | {c.get('compute_s', float('nan')):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """The sharded rows merged by name into --out's configs, and its `shard_cards` (the smaller entry point than
    `bench.memory --families` / `--nodes`, which leave the sharded rows and columns as they are)."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m bench.memory_shard", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "memory.json"))
    ap.add_argument("--only", default=",".join(SHARD_ROWS))
    ap.add_argument("--no-cards", action="store_true", help="the rows only, not the card table's columns")
    args = ap.parse_args(argv)
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {"configs": []}
    measured = {r["name"]: r for r in doc.get("configs", [])}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        new = []
        for name in args.only.split(","):
            new.append(row(name, Path(tmp), measured=measured))
            r = new[-1]
            print(f"  {name:<42} preflight {r['preflight_gib']:6.2f} GiB  derived peak {r['peak_gib']:6.2f}  held "
                  f"{r['measured_gib']:6.2f}  host {r['host_gib']:5.2f} (machine {r['machine_host_gib']:5.1f})  "
                  f"{r['seconds']:.1f} s", flush=True)
        if not args.no_cards:
            doc["shard_cards"], doc["shard_run_cards"] = shard_cards(Path(tmp))
    names = {r["name"] for r in new}
    doc["configs"] = [r for r in doc.get("configs", []) if r["name"] not in names] + new
    doc["shard_links_gb_s"] = {k: v / 1e9 for k, v in LINKS.items()}
    doc["shard_seconds"] = time.perf_counter() - t0
    out.write_text(json.dumps(doc, indent=1, default=list))
    print("\n" + table(new))
    for key, per in doc.get("shard_cards", {}).items():
        print(f"| {key} | " + " | ".join(per.values()) + " |")
    print(f"wrote {out} in {doc['shard_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
