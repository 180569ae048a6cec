"""Issue 45's speed figures: the train node's FLUX.1-dev step per setting, each against bf16 in the same run.

    python -m bench.gpu_speed                 # a CUDA GPU: FLUX.1-dev, 1024 px (bench/gpu_speed.json)
    python -m bench.gpu_speed --tiny          # smoke test: a tiny Flux, any machine (bench/gpu_speed_tiny.json)
    python -m bench.gpu_speed --only bf16,int8+w8a8 --merge bench/gpu_results.json

Each setting is built by the train node's own prepare_denoiser (random bf16 weights made on the device, stored as
`model.quantize` says, `model.matmul`, `train.blocks_to_swap`, `train.compile` applied as a run applies them) and
timed over `--steps` steps after `--warmup` (the first compiled step's time is its compile, reported apart). bf16
runs first and again last: the two bound the drift of the machine over the run. For every setting: the median
step, its ratio to bf16, the peak memory, the matmul path the report would name, and MFU: the step's FLOPs
(torch's FlopCounterMode over one bf16 step: forward, recompute, input and LoRA gradients) over the step time and
the card's dense bf16 peak (H100/H200 SXM: 989 TFLOP/s; an fp8 or int8 matmul's peak is twice that, so W8A8 rows
can pass 100 % of this figure's scale only in principle).

The goals (issue 45): fp8 <= 1.0x, int8 <= 1.1x, nf4 <= 1.25x bf16 (nf4+bnb: bitsandbytes' matmul_4bit, the
path auto takes on a GPU; `nf4` is the torchao fallback's figure); int8 with 10 blocks swapped <= 1.1x int8
without; compiled bf16 >= 1.2x faster than eager."""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

from bench.flux_train import FLUX_DEV, TINY, TRAIN_CFG, inputs, random_model, train_step

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}

# name -> (model overrides, train overrides); every setting with gradient checkpointing, as users run big bases
SETTINGS = {
    "bf16": ({}, {}),
    "fp8": ({"quantize": "fp8", "matmul": "dequantize"}, {}),
    "fp8+w8a8": ({"quantize": "fp8", "matmul": "w8a8"}, {}),
    "int8": ({"quantize": "int8", "matmul": "dequantize"}, {}),
    "int8+w8a8": ({"quantize": "int8", "matmul": "w8a8"}, {}),
    "nf4": ({"quantize": "nf4", "matmul": "dequantize"}, {}),
    "nf4+bnb": ({"quantize": "nf4", "matmul": "bnb"}, {}),
    "int8+w8a8+swap10": ({"quantize": "int8", "matmul": "w8a8"}, {"blocks_to_swap": 10}),
    "int8+swap10": ({"quantize": "int8", "matmul": "dequantize"}, {"blocks_to_swap": 10}),
    "bf16+compile": ({}, {"compile": True}),
    "int8+w8a8+compile": ({"quantize": "int8", "matmul": "w8a8"}, {"compile": True}),
    "int8+compile": ({"quantize": "int8", "matmul": "dequantize"}, {"compile": True}),
}
# (setting, reference, goal as "<= x" of setting/reference step) for the figures
GOALS = (("fp8", "bf16", 1.0), ("fp8+w8a8", "bf16", 1.0), ("int8", "bf16", 1.1), ("int8+w8a8", "bf16", 1.1),
         ("nf4+bnb", "bf16", 1.25), ("int8+w8a8+swap10", "int8+w8a8", 1.1), ("int8+swap10", "int8", 1.1),
         ("bf16+compile", "bf16", 1 / 1.2))


def build(arch: dict, device, name: str, rank: int):
    """(adapter, denoiser, LoRA parameters, runtime entry) for one setting, by the train node's own code."""
    from diffusers import FluxTransformer2DModel

    from tasks.models.flux import FluxAdapter
    from tasks.training import w8a8
    from tasks.training.compiled_blocks import compile_blocks, matmul_path
    from tasks.training.train_setup import prepare_denoiser
    from tasks.config import config_of, stored_as

    class RandomFlux(FluxAdapter):
        def load_denoiser(self):
            return random_model(FluxTransformer2DModel, arch, device)

    model, train = SETTINGS[name]
    if train.get("blocks_to_swap"):  # the tiny smoke test's model has fewer blocks: all but one swapped
        blocks = arch["num_layers"] + arch["num_single_layers"]
        train = {**train, "blocks_to_swap": min(train["blocks_to_swap"], blocks - 1)}
    adapter = RandomFlux(HERE, "bfloat16")  # (no model folder is read)
    cfg = config_of({"model": {"storage_dtype": None, "storage_modulation": False, "quantize": "none", "matmul": "auto",
                               **model},
                     "train": {"rank": rank, "alpha": None, "target_modules": None, "gradient_checkpointing": True,
                               "blocks_to_swap": 0, **train}})
    denoiser, named = prepare_denoiser(adapter, cfg, stream=False)
    denoiser.train()
    compiled = compile_blocks(denoiser, adapter.swap_blocks) if train.get("compile") else 0
    runtime = {"matmul": matmul_path(stored_as(cfg.model), "bfloat16", w8a8.resolve(cfg.model)),
               "compiled_blocks": compiled, "blocks_to_swap": train.get("blocks_to_swap", 0)}
    return adapter, denoiser, list(named.values()), runtime


def step_flops(adapter, model, params, latents, text) -> float:
    """FLOPs of one step (forward, checkpoint recompute, backward), counted by torch's FlopCounterMode."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.autocast(latents.device.type, dtype=torch.bfloat16):
        loss = adapter.training_loss(model, latents, text, TRAIN_CFG, FlowMatchEulerDiscreteScheduler(),
                                     [torch.Generator().manual_seed(0)])
        loss.backward()
    for p in params:
        p.grad = None
    return float(counter.get_total_flops())


def measure(name: str, args, arch: dict, device, count_flops: bool = False) -> dict:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from tasks.training.train_setup import make_optimizer

    cuda = device.type == "cuda"
    out = {"name": name, "step_s": [], "error": None}
    model = params = opt = None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        adapter, model, params, out["runtime"] = build(arch, device, name, args.rank)
        out["build_s"] = time.perf_counter() - t
        latents, text = inputs(arch, args.resolution, args.text_len, 1, device)
        if count_flops:
            out["flops"] = step_flops(adapter, model, params, latents, text)
        opt = make_optimizer(TRAIN_CFG, params)
        scheduler = FlowMatchEulerDiscreteScheduler()
        for step in range(args.warmup + args.steps):
            t = time.perf_counter()
            train_step(adapter, model, params, opt, scheduler, latents, text, [torch.Generator().manual_seed(step)])
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if step == 0:
                out["first_step_s"] = dt  # with train.compile: the compile
            if step >= args.warmup:
                out["step_s"].append(dt)
            print(f"  {name}: step {step + 1}/{args.warmup + args.steps} {dt:.3f} s", flush=True)
    except Exception as e:  # recorded; the next setting still runs
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        del model, params, opt
        gc.collect()
        if cuda:
            out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            torch.cuda.empty_cache()
    out["step_median_s"] = statistics.median(out["step_s"]) if out["step_s"] else None
    return out


def peak_flops(device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def figures(rows: dict[str, dict]) -> list[dict]:
    out = []
    for name, ref, goal in GOALS:
        a, b = rows.get(name, {}).get("step_median_s"), rows.get(ref, {}).get("step_median_s")
        if a and b:
            out.append({"name": f"{name} step vs {ref} (FLUX.1-dev, 1024 px, checkpointing)", "value": a / b,
                        "unit": "x", "goal": f"<= {goal:.3g}", "meets": a / b <= goal})
    return out


def merge(speed_file, results_file) -> None:
    """The speed figures into a bench.gpu results file's `figures` (contract.md), replacing older ones."""
    speed, results = Path(speed_file), Path(results_file)
    if not (speed.is_file() and results.is_file()):
        return
    merged, figs = json.loads(results.read_text()), json.loads(speed.read_text())["figures"]
    names = {f["name"] for f in figs}
    merged["figures"] = [f for f in merged.get("figures", []) if f["name"] not in names] + figs
    results.write_text(json.dumps(merged, indent=1, default=str) + "\n")


def write(out: Path, rows: dict, args, device, t0: float) -> None:
    """The result so far (ratios, MFU, figures) to `out`, atomically."""
    import torch

    flops, peak = rows["bf16"].get("flops"), peak_flops(device)
    for r in rows.values():
        if r.get("step_median_s") and rows["bf16"].get("step_median_s"):
            r["vs_bf16"] = r["step_median_s"] / rows["bf16"]["step_median_s"]
        if flops and peak and r.get("step_median_s"):
            r["mfu"] = flops / r["step_median_s"] / peak
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "arch": "tiny" if args.tiny else "FLUX.1-dev", "resolution": args.resolution, "rank": args.rank,
              "step_flops": flops, "peak_bf16_flops": peak, "settings": list(rows.values()),
              "figures": figures(rows), "seconds": round(time.time() - t0, 1)}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(out)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m bench.gpu_speed", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny Flux at 128 px, 1 step: a smoke test on any machine")
    ap.add_argument("--only", default=",".join(SETTINGS), help="comma list of " + ", ".join(SETTINGS))
    ap.add_argument("--steps", type=int, default=None, help="measured steps per setting (default 4; --tiny 1)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 2; --tiny 1)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default 1024; --tiny 128)")
    ap.add_argument("--text-len", type=int, default=None, help="T5 tokens (default 512; --tiny 16)")
    ap.add_argument("--out", default=None, help="default bench/gpu_speed.json (--tiny: bench/gpu_speed_tiny.json)")
    ap.add_argument("--merge", default=None, help="a bench.gpu results file whose `figures` gain these")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds: start no setting after this (bf16's re-run still)")
    args = ap.parse_args(argv)
    arch = TINY if args.tiny else FLUX_DEV
    args.steps = args.steps or (1 if args.tiny else 4)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.resolution = args.resolution or (128 if args.tiny else 1024)
    args.text_len = args.text_len or (16 if args.tiny else 512)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    wanted = [n for n in args.only.split(",") if n]
    unknown = sorted(set(wanted) - set(SETTINGS))
    if unknown:
        print(f"--only: unknown setting(s) {unknown}; choose from {', '.join(SETTINGS)}", file=sys.stderr)
        return 2
    order = ["bf16", *[n for n in wanted if n != "bf16"], "bf16"]  # bf16 first and last: the drift
    out = Path(args.out or HERE / ("gpu_speed_tiny.json" if args.tiny else "gpu_speed.json"))
    rows, t0 = {}, time.time()
    for i, name in enumerate(order):
        if args.budget and time.time() - t0 > args.budget and 0 < i < len(order) - 1:
            print(f"{name}: not started, past --budget {args.budget:.0f} s", flush=True)
            continue
        print(f"{name} ...", flush=True)
        r = measure(name, args, arch, device, count_flops=(i == 0))
        if i and name == "bf16":
            rows["bf16"]["again_step_median_s"] = r["step_median_s"]
        else:
            rows[name] = r
        write(out, rows, args, device, t0)  # after every setting: a run cut short keeps what it measured
    if args.merge:
        merge(out, args.merge)
    for r in rows.values():
        print(f"{r['name']:>20}: {r.get('step_median_s') or float('nan'):.3f} s  x{r.get('vs_bf16', float('nan')):.3f}"
              f"  MFU {r.get('mfu', float('nan')):.3f}  peak {r.get('peak_gib') or float('nan'):.2f} GiB"
              f"  {r.get('error') or r.get('runtime', {}).get('matmul', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
