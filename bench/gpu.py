"""Full-size FLUX.1-dev LoRA training on one GPU: step time and peak VRAM for three memory settings.

    python -m bench.gpu              # needs CUDA; writes bench/gpu_results.json and prints a table
    python -m bench.gpu --tiny       # a shrunken config, 1 step, on the CPU if there is no GPU (smoke test)
    python -m bench.gpu --weights    # any machine: the full-size model on the meta device, exact bytes held by
                                     # its weights and LoRA per configuration (bench/gpu_weights.json)

What runs is loraflow's own training step, not a copy of it: the denoiser is prepared by the train node's
`tasks.training.train_setup.prepare_denoiser` (frozen base, peft LoRA on the Flux adapter's default targets, fp32 LoRA
weights, the autograd-safe fp8 base of tasks/training/fp8_base.py, gradient checkpointing), the loss is the Flux
adapter's `training_loss` (flow-matching noise and timesteps, 2x2 packing, velocity MSE), the optimizer is
`tasks.training.train_setup.make_optimizer` (AdamW) and the step runs under bf16 autocast as `train.mixed_precision=bf16`
does. Only the weights differ: FLUX.1-dev's transformer config (19 double + 38 single blocks, 24 heads x 128
= 3072 wide, T5 width 4096, CLIP pooled 768, guidance_embeds=True, ~11.9 B parameters) with random bf16
weights made directly on the GPU (nothing is downloaded). One 1024x1024 image per step (latents 16x128x128,
4096 image tokens); the text is cached: random T5 states 512x4096 and a pooled CLIP vector of 768.

Configurations, each in its own try/except (an OOM is recorded, not fatal):
  bf16            bf16 base, no gradient checkpointing
  bf16+ckpt       bf16 base, gradient checkpointing                  (train.gradient_checkpointing=true)
  fp8+ckpt        fp8 e4m3 base, bf16 compute, gradient checkpointing (model.storage_dtype=float8_e4m3fn)
  fp8-all+ckpt    as fp8+ckpt, the AdaLN modulation linears in fp8 too   (model.storage_modulation=true)
Peak VRAM is torch.cuda.max_memory_allocated over the training steps (after building the model, whose own
transient peak is reported separately); goals: <= 24 GiB with checkpointing, fp8+checkpointing aims for 16 GiB.
Beside each peak: the validate node's preflight estimate for the same settings (goal: within 10 %) and
bench.memory's CPU-measured bytes (bench/memory.json). Then, side by side in the same run (bench/gpu_bare.py):
the train step against a bare diffusers + peft loop (goal <= 1.05x) and latent caching against a bare VAE loop
(goal >= 0.95x). `--families FILE` merges bench.gpu_families' results (every family's DAG through the CLI).

On the GPU image of this workplace diffusers, hydra-core, omegaconf and antlr4 are missing: bench/gpu_wheels.sh
downloads them as wheels to carry (see bench/README.md).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the training setup, shared with the units, the bare loops and bench.memory (re-exported for callers)
from bench.flux_train import (CONFIGS, FLUX_DEV, LABELS, TINY, TRAIN_CFG, TRAIN_SETTINGS, build, bytes_by_dtype, inputs,  # noqa: E402,F401
                              run_config, train_step)
GIB = 1 << 30


def run_units(*a):
    from bench.gpu_units import run_units as run

    return run(*a)


def run_unit_here(*a):
    from bench.gpu_units import run_unit_here as run

    return run(*a)


def weights_only(out_path: Path, rank: int) -> int:
    """The full-size model prepared for each configuration on the meta device (no memory, no GPU): the bytes
    its weights hold, by dtype, and the preflight estimate's weight term for the same settings."""
    import torch

    rows = []
    for name, fp8, ckpt, modulation in CONFIGS:
        _, model, params = build(FLUX_DEV, torch.device("meta"), fp8, ckpt, rank, modulation)
        lora = {id(p) for p in params}
        base = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in lora)
        rows.append({"config": name, "params": sum(p.numel() for p in model.parameters()),
                     "lora_params": sum(p.numel() for p in params), "weights_gib": base / GIB,
                     "lora_fp32_gib": sum(p.numel() * 4 for p in params) / GIB,
                     "weightbytes_by_dtype_gib": bytes_by_dtype(model)})
        print(f"  {LABELS[name]:<52} weights {base / GIB:6.2f} GiB  by dtype {rows[-1]['weightbytes_by_dtype_gib']}")
    out_path.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                    "arch": FLUX_DEV, "rank": rank, "torch": torch.__version__,
                                    "configs": rows}, indent=1, default=str))
    print(f"\nwrote {out_path}")
    return 0


def figures(results: list[dict]) -> list[dict]:
    def fig(name, value, unit, goal, meets):
        return {"name": name, "value": float("nan") if value is None else float(value), "unit": unit, "goal": goal,
                "meets": bool(meets)}

    figs = []
    for r in results:
        ok = r["error"] is None
        label = LABELS[r["config"]]
        state = "" if ok else (" (OOM)" if r["oom"] else " (error)")
        peak = r["peak_gib"]
        if r["config"] == "bf16":
            figs.append(fig(f"{label}: peak VRAM{state}", peak, "GiB", "reference: fits in GPU memory", ok))
        else:
            figs.append(fig(f"{label}: peak VRAM{state}", peak, "GiB", "<= 24", ok and peak is not None and peak <= 24))
        if r["config"].startswith("fp8"):
            figs.append(fig(f"{label}: peak VRAM vs the 16 GiB aim{state}", peak, "GiB", "<= 16 (aim)",
                            ok and peak is not None and peak <= 16))
        figs.append(fig(f"{label}: step time{state}", r["step_median_s"], "s", "reference (median step)", ok))
    return figs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="shrunken config, 1 step, CPU if no GPU (smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per config (default 5; --tiny 1)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 2; --tiny 0)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default 1024; --tiny 128)")
    ap.add_argument("--text-len", type=int, default=None, help="T5 tokens (default 512; --tiny 16)")
    ap.add_argument("--only", default=",".join(c[0] for c in CONFIGS), help="comma list of " +
                    ", ".join(c[0] for c in CONFIGS))
    ap.add_argument("--out", default=None, help="default bench/gpu_results.json (--tiny: bench/gpu_results_tiny.json)")
    ap.add_argument("--families", default=None, help="bench.gpu_families' JSON to merge (its `families`)")
    ap.add_argument("--bare-rounds", type=int, default=None, help="train step vs bare: alternated rounds (default 5)")
    ap.add_argument("--bare-steps", type=int, default=3, help="train step vs bare: steps per round")
    ap.add_argument("--latent-images", type=int, default=None, help="latent caching vs bare: images (default 24)")
    ap.add_argument("--in-process", action="store_true", help="every configuration in this process (default on "
                    "CUDA: each in its own, so a CUDA error cannot take the rest down)")
    ap.add_argument("--sdpa", default="default", choices=("default", "no-cudnn"), help="no-cudnn: attention "
                    "without cuDNN's kernel (the retry after a CUDA error)")
    ap.add_argument("--budget", type=float, default=None, help="seconds: past half of it, a failed unit is not "
                    "retried")
    ap.add_argument("--unit", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--unit-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--weights", action="store_true", help="the full-size model on the meta device: bytes held "
                    "by its weights per configuration (no GPU needed)")
    args = ap.parse_args(argv)

    import torch

    if args.weights:
        return weights_only(Path(args.out or HERE / "gpu_weights.json"), args.rank)

    if args.unit:  # one unit in this process, for bench/gpu_units.py's parent
        return run_unit_here(args, TINY if args.tiny else FLUX_DEV)
    if not torch.cuda.is_available() and not args.tiny:
        print("bench/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False "
              f"(torch {torch.__version__}). Run it on a GPU machine with a CUDA build of torch, or use --tiny to "
              "smoke-test the model construction and one training step on the CPU.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arch = TINY if args.tiny else FLUX_DEV
    args.steps = args.steps if args.steps is not None else (1 if args.tiny else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 2)
    args.resolution = args.resolution or (128 if args.tiny else 1024)
    args.text_len = args.text_len or (16 if args.tiny else 512)
    args.bare_rounds = args.bare_rounds or (2 if args.tiny else 5)
    args.latent_images = args.latent_images or (4 if args.tiny else 24)
    out_path = Path(args.out or HERE / ("gpu_results_tiny.json" if args.tiny else "gpu_results.json"))
    args.out = str(out_path)
    wanted = set(args.only.split(","))

    device_name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    total_gib = torch.cuda.get_device_properties(0).total_memory / GIB if device.type == "cuda" else None
    print(f"bench.gpu: {'TINY ' if args.tiny else ''}Flux transformer on {device_name}"
          f"{f' ({total_gib:.0f} GiB)' if total_gib else ''}, {args.resolution}px "
          f"({(args.resolution // 16) ** 2} image tokens), text {args.text_len} tokens, batch {args.batch}, "
          f"LoRA rank {args.rank}", flush=True)
    t0 = time.perf_counter()
    results, extra = run_units(args, arch, device, [c for c in CONFIGS if c[0] in wanted])
    figs = figures(results) + extra.pop("figures")
    from bench.gpu_units import contract

    doc = {**contract(device_name, results, extra, args.families), "figures": figs, "machine": {"device": device_name, "total_gib": total_gib, "torch": torch.__version__,
                                        "cuda": torch.version.cuda},
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "config": {"tiny": args.tiny, "arch": arch, "resolution": args.resolution, "text_len": args.text_len,
                      "batch": args.batch, "rank": args.rank, "steps": args.steps, "warmup": args.warmup,
                      "train": TRAIN_SETTINGS, "prepared_by": "tasks.training.train_setup.prepare_denoiser",
                      "loss": "tasks.models.flux.FluxAdapter.training_loss", "autocast": "bf16"},
           "details": results, "total_seconds": time.perf_counter() - t0}
    out_path.write_text(json.dumps(doc, indent=1, default=str))
    rows = [("figure", "value", "goal", "meets")]
    for f in figs:
        rows.append((f["name"], "n/a" if math.isnan(f["value"]) else f"{f['value']:.3f} {f['unit']}", f["goal"],
                     "yes" if f["meets"] else "NO"))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    print()
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for r in results:
        if r["error"]:
            print(f"  {r['config']}: {r['error']}")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
