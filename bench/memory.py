"""What FLUX.1-dev LoRA training holds, measured from real tensors on the CPU (no GPU needed).

    python -m bench.memory [--out bench/memory.json] [--rank 16] [--only bf16,fp8+ckpt]
    python -m bench.memory --families [--only qwenimage:nf4+ckpt,...]   # Qwen-Image, FLUX.2 [dev], FLUX.1-dev rows
    python -m bench.memory --nodes [--only flux2_dev:cache_text:nf4,...]  # cache_text, sample, cache_latents rows
    python -m bench.memory_shard [--only flux2_dev:bf16+ckpt+fsdp2,...]  # +fsdpN rows (per process) and multi-GPU cards

Weights: the exact bytes of the model the train node prepares (bench/gpu.py `build`, i.e.
tasks.training.train_setup.prepare_denoiser: peft LoRA on the Flux adapter's default targets, fp32 LoRA, the fp8 base of
tasks/training/fp8_base.py, gradient checkpointing). LoRA: fp32 weights + fp32 gradients + optimizer state (AdamW: two
fp32 moments, 8 bytes a parameter; 8-bit AdamW: two 1-byte moments, 2 bytes a parameter).

Activations: one training forward (the Flux adapter's own `training_loss`, under bf16 autocast as
`train.mixed_precision=bf16` runs it) and backward of the full 19 + 38 block model, with every tensor autograd
saves seen through `torch.autograd.graph.saved_tensors_hooks`; each distinct storage counted once, module
parameters (bf16/fp8 base weights, LoRA weights) left out (they are the weight term). With gradient
checkpointing, what the outer hook sees is each block's checkpointed inputs; the block internals a recompute
saves during backward are caught by wrapping torch.utils.checkpoint's recomputation hook, and the largest
recompute is added. The model runs under FakeTensorMode: tensors carry real shapes, dtypes and the CPU device
(so CPU autocast and the CPU attention kernel choice apply) but hold no memory and do no arithmetic.
tests/test_bench_memory.py checks the byte counts equal a real CPU run's at a reduced size.

What is held = weights + LoRA, gradients, optimizer + saved activations (+ the largest recompute). Left out:
transient buffers (the gradients in flight, one layer's upcast or dequantized weight): `peak_gib` counts them,
the peak of live tensor bytes over the whole step (bench/memory_peak.py), what a GPU's max_memory_allocated
shows; neither has the CUDA context, kernel workspaces or allocator fragmentation (bench/gpu.py measures those).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.fake_step import SavedTensors, count_step, model_headers, storage_key, to_fake  # noqa: F401

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
# (name, fp8 base, gradient checkpointing, modulation linears in fp8 too)
CONFIGS = (("bf16", False, False, False), ("fp8", True, False, False), ("bf16+ckpt", False, True, False),
           ("fp8+ckpt", True, True, False), ("fp8-all+ckpt", True, True, True))
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2}  # per LoRA parameter: two fp32 moments / two 1-byte moments


def measure(arch: dict, resolution: int, text_len: int, fp8: bool, ckpt: bool, modulation: bool, rank: int,
            fake: bool = True) -> dict:
    """Bytes one training step of this configuration holds (see the module doc). `fake=False`: real tensors."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.flux_train import build, inputs

    cpu = torch.device("cpu")
    scheduler = FlowMatchEulerDiscreteScheduler()
    torch.manual_seed(0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    # Fake: prepared on the meta device (peft's and fp8's conversions do not run on fake tensors), then each
    # parameter becomes a fake CPU tensor with the same shape, dtype and requires_grad.
    adapter, model, params = build(arch, torch.device("meta") if fake else cpu, fp8, ckpt, rank, modulation)
    if fake:
        params = to_fake(model, params, mode)
    with mode or contextlib.nullcontext():
        lora = {storage_key(p) for p in params}
        weights = sum(p.numel() * p.element_size() for p in model.parameters() if storage_key(p) not in lora)
        lora_params = sum(p.numel() for p in params)
        latents, text = inputs(arch, resolution, text_len, 1, cpu)
        grads, saved, recompute = count_step(adapter, model, params, latents, text, scheduler)
        del model, params, latents, text
    return {"weights_bytes": weights, "lora_params": lora_params, "lora_grad_bytes": grads,
            "saved_bytes": saved, "recompute_bytes": recompute, "activation_bytes": saved + recompute}


def write_headers(folder: Path, arch: dict) -> Path:
    """The denoiser as the preflight estimate reads it: config.json + a header-only safetensors file (bf16
    shapes, no weights), from the model built on the meta device."""
    import torch
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**arch)
    return model_headers(model, Path(folder))


def preflight(folder: Path, resolution: int, text_len: int, fp8: bool, ckpt: bool, modulation: bool, rank: int,
              optimizer: str = "adamw") -> dict:
    """tasks.training.memory.estimate for the same configuration, as the validate node computes it."""
    from diffusers import FluxTransformer2DModel

    from tasks.config import config_of
    from tasks.training.memory import estimate
    from tasks.models.flux import FluxAdapter

    cfg = config_of({"model": {"dtype": "bfloat16", "storage_dtype": "float8_e4m3fn" if fp8 else None,
                               "storage_modulation": modulation, "max_sequence_length": text_len},
                     "train": {"rank": rank, "batch_size": 1, "optimizer": optimizer, "mixed_precision": "bf16",
                               "gradient_checkpointing": ckpt}})
    return estimate(cfg, folder, "transformer", FluxAdapter.LORA_TARGETS, (resolution, resolution),
                    text_len, FluxTransformer2DModel, geometry=FluxAdapter.activation_geometry)


def row(name: str, resolution: int, text_len: int, fp8: bool, ckpt: bool, modulation: bool, rank: int,
        arch: dict, folder: Path) -> dict:
    t = time.perf_counter()
    m = measure(arch, resolution, text_len, fp8, ckpt, modulation, rank)
    lora_bytes = m["lora_params"] * 4 + m["lora_grad_bytes"]  # fp32 weights + their gradients
    held = {opt: m["weights_bytes"] + lora_bytes + m["lora_params"] * b + m["activation_bytes"]
            for opt, b in OPTIMIZER_BYTES.items()}
    est = preflight(folder, resolution, text_len, fp8, ckpt, modulation, rank)
    from bench.memory_peak import breakdown, flux_peak

    peak = flux_peak(arch, resolution, text_len, fp8, ckpt, modulation, rank)  # live storages, the whole step
    return {"name": name, "measured_gib": held["adamw"] / GIB, "preflight_gib": est["total_gb"], "host_gib": 0.0,
            "peak_gib": peak["peak_bytes"] / GIB, "peak_phase": peak["phase"], "peak_breakdown_gib": breakdown(peak),
            "preflight_transient_gib": est["transient_gb"],
            "estimate_error": est["total_gb"] / (held["adamw"] / GIB) - 1,
            "resolution": resolution, "image_tokens": (resolution // 16) ** 2, "text_tokens": text_len,
            "rank": rank, "fp8": fp8, "checkpointing": ckpt, "modulation_fp8": modulation,
            "weights_gib": m["weights_bytes"] / GIB, "lora_params": m["lora_params"],
            "lora_and_grads_gib": lora_bytes / GIB, "adamw_state_gib": m["lora_params"] * 8 / GIB,
            "measured_adamw8bit_gib": held["adamw8bit"] / GIB,
            "saved_activations_gib": m["saved_bytes"] / GIB, "recompute_gib": m["recompute_bytes"] / GIB,
            "activations_gib": m["activation_bytes"] / GIB, "preflight_activations_gib": est["activations_gb"],
            "preflight_weights_gib": est["weights_gb"], "seconds": time.perf_counter() - t}


TABLE_HEAD = ("| config | size | weights | LoRA + grads + AdamW | saved activations | + recompute | measured | "
              "peak | preflight |\n|---|---|---|---|---|---|---|---|---|")


def table(rows: list[dict]) -> str:
    lines = [TABLE_HEAD]
    for r in rows:
        lines.append(f"| {r['name']} | {r['resolution']} | {r['weights_gib']:.2f} | "
                     f"{r['lora_and_grads_gib'] + r['adamw_state_gib']:.2f} | {r['saved_activations_gib']:.2f} | "
                     f"{r['recompute_gib']:.2f} | {r['measured_gib']:.2f} | {r['peak_gib']:.2f} | "
                     f"{r['preflight_gib']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import tempfile

    import torch

    from bench.flux_train import FLUX_DEV

    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "memory.json"), help="JSON file (default bench/memory.json)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--text-len", type=int, default=512, help="T5 tokens (default 512)")
    ap.add_argument("--resolutions", default="1024,512", help="comma list of square sizes in pixels")
    ap.add_argument("--no-check", action="store_true", help="skip the real-CPU check of the fake-tensor count")
    ap.add_argument("--only", default=",".join(c[0] for c in CONFIGS), help="comma list of " +
                    ", ".join(c[0] for c in CONFIGS))
    ap.add_argument("--families", action="store_true", help="the big bases' rows <model>:<options> "
                    "(bench/memory_families.py: quantized bases, block swap), merged into --out")
    ap.add_argument("--nodes", action="store_true", help="the other nodes' rows <model>:<node>:<options> and the "
                    "whole run's card table (bench/memory_nodes.py), merged into --out")
    args = ap.parse_args(argv)
    if args.nodes:
        from bench import memory_nodes

        return memory_nodes.main(Path(args.out), None if args.only == ap.get_default("only") else args.only)
    if args.families:
        from bench import memory_families

        from bench.memory_nodes import cards

        return memory_families.main(Path(args.out), None if args.only == ap.get_default("only") else args.only, cards)
    wanted = set(args.only.split(","))
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_headers(Path(tmp), FLUX_DEV)
        for i, res in enumerate(int(r) for r in args.resolutions.split(",")):
            for name, fp8, ckpt, modulation in CONFIGS:
                if name in wanted:
                    label = name if i == 0 else f"{name}@{res}"  # the first size keeps the plain names
                    rows.append(row(label, res, args.text_len, fp8, ckpt, modulation, args.rank, FLUX_DEV, folder))
                    r = rows[-1]
                    print(f"  {label:<18} measured {r['measured_gib']:6.2f} GiB  peak {r['peak_gib']:6.2f} GiB  preflight {r['preflight_gib']:6.2f} "
                          f"GiB ({r['estimate_error'] * 100:+.1f} %)  {r['seconds']:.1f} s", flush=True)
    check = None if args.no_check else real_check(FLUX_DEV, args.rank, wanted)
    goal = next((r for r in rows if r["name"] == "fp8+ckpt"), None)
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpu": _cpu_name(), "cores": __import__("os").cpu_count(), "torch": torch.__version__,
                       "python": platform.python_version()},
           "method": "FakeTensorMode on the CPU: real shapes and dtypes, saved_tensors_hooks, distinct storages, "
                     "parameters excluded; see bench/memory.py",
           "arch": FLUX_DEV, "rank": args.rank, "text_tokens": args.text_len, "optimizer_bytes": OPTIMIZER_BYTES,
           "goal": None if goal is None else {"config": "fp8+ckpt", "limit_gib": 16,
                                              "measured_gib": goal["measured_gib"],
                                              "meets": goal["measured_gib"] <= 16,
                                              "over_by_gib": max(0.0, goal["measured_gib"] - 16)},
           "configs": rows, "check": check, "total_seconds": time.perf_counter() - t0}
    if Path(args.out).exists():  # the families' rows (and their card table) are kept: `--families` merges them
        old = json.loads(Path(args.out).read_text())
        doc["configs"] = rows + [r for r in old.get("configs", []) if ":" in r["name"]]
        doc.update({k: old[k] for k in ("family_goals", "cards", "train_cards", "run_cards", "run_goals",
                                        "families_seconds", "nodes_seconds", "shard_cards", "shard_run_cards",
                                        "shard_links_gb_s", "shard_seconds") if k in old})
    Path(args.out).write_text(json.dumps(doc, indent=1, default=list))
    print("\n" + table(rows) + f"\n\nwrote {args.out} in {doc['total_seconds']:.0f} s")
    return 0 if check is None or check["all_equal"] else 1


def real_check(arch: dict, rank: int, wanted: set) -> dict:
    """FLUX.1-dev's width, heads and LoRA with 1 double + 1 single block at 64 image + 16 text tokens, run on
    real CPU tensors and on fake ones: every byte count (the live peak of bench/memory_peak.py too) must be equal
    (else the fake figures are not trusted)."""
    from bench.memory_peak import flux_peak

    small = dict(arch, num_layers=1, num_single_layers=1)
    out = {"arch": "FLUX.1-dev width, 1 double + 1 single block", "image_tokens": 64, "text_tokens": 16,
           "configs": {}}
    for name, fp8, ckpt, modulation in CONFIGS:
        if name in wanted:
            real = measure(small, 128, 16, fp8, ckpt, modulation, rank, fake=False)
            fake = measure(small, 128, 16, fp8, ckpt, modulation, rank, fake=True)
            flux_peak(small, 128, 16, fp8, ckpt, modulation, rank)  # imports what the step imports lazily
            peaks = [flux_peak(small, 128, 16, fp8, ckpt, modulation, rank, fake=f)["peak_bytes"] for f in (False, True)]
            real["peak_bytes"], fake["peak_bytes"] = peaks
            out["configs"][name] = {"real": real, "fake": fake, "equal": real == fake}
            print(f"  check {name:<14} real == fake: {real == fake} (saved {real['saved_bytes']} B, recompute "
                  f"{real['recompute_bytes']} B)", flush=True)
    out["all_equal"] = all(c["equal"] for c in out["configs"].values())
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    sys.exit(main())
