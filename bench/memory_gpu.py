"""bench.memory's family rows (`<model>:<options>`) measured on a GPU: torch.cuda.max_memory_allocated over real
training steps, beside the CPU figures (peak_gib, preflight_gib) the row has in bench/memory.json.

    python -m bench.memory_gpu [--only wan22_ti2v_5b:nf4+ckpt,...] [--budget 300] [--out FILE]   # needs CUDA
    python -m bench.memory_gpu --merge FILE      # any machine: FILE's figures into bench/memory.json's rows

Each row runs in its own process (a CUDA out-of-memory or a poisoned context costs that row only; the allocator
starts empty): the model's adapter with random bf16 weights made on the GPU at its real architecture
(bench/family_models.py: random_adapter), prepared by the train node's own prepare_denoiser with the row's options
(model.quantize, gradient checkpointing and its offload, train.blocks_to_swap; model.matmul=auto, so an NF4 base
multiplies through bitsandbytes where its CUDA library loads: `matmul` in the result), one batch of the row's
geometry (batch_inputs, zeros), AdamW, bf16 autocast, rank 16 on the family's default targets: `--steps` steps
(default 2: AdamW's moments exist from the first step's end, so the second step holds everything a run holds),
the peak counted from after the build (the build's own transient, the bf16 weights before they are quantized, is
not training's; the streamed loader never holds them). Rows are started while `--budget` seconds are left; the
JSON is written after each.

Per row: gpu_peak_gib (max_memory_allocated), gpu_reserved_gib (max_memory_reserved: with the allocator's
fragmentation), resident_gib (allocated before the first step: weights, LoRA), step_s, matmul, and
preflight_error = preflight_gib / gpu_peak_gib - 1 against the row's committed preflight (the issue's goal: 10 %).
`--merge` writes gpu_peak_gib, gpu_reserved_gib, gpu_step_s, gpu_device and gpu_preflight_error into the rows of
bench/memory.json with the same name; measured_gib stays the CPU count (bench/memory_families.py)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
# The order a lent GPU measures them in: each image-to-video model's 24 GB setting first (issue 47 item 5), then
# its others; about 1.5-2 min a row at 81 frames (480x832) on an H100/H200, under 1 min for TI2V-5B
PRIORITY = ("wan22_ti2v_5b:nf4+ckpt", "wan21_i2v_14b:nf4+ckpt+offload+swap17", "wan22_i2v_a14b:nf4+ckpt+offload+swap11",
            "wan22_ti2v_5b:nf4+ckpt+offload+swap24", "wan22_ti2v_5b_49f:nf4+ckpt+offload",
            "wan21_i2v_14b_33f:nf4+ckpt+offload+swap31", "wan22_ti2v_5b:bf16+ckpt", "wan21_i2v_14b:nf4+ckpt")


def measure(name: str, steps: int = 2, device=None, rank: int = 16, text_len: int = 512) -> dict:
    """One row's training steps on `device` (CUDA; the CPU runs the same code without a peak, for the tests)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from bench.family_models import batch_inputs, parse, random_adapter, train_config
    from bench.flux_train import TRAIN_CFG, train_step
    from tasks.config import stored_as
    from tasks.training import w8a8
    from tasks.training.compiled_blocks import matmul_path
    from tasks.training.train_setup import make_optimizer, prepare_denoiser

    device = device or torch.device("cuda")
    cuda = device.type == "cuda"
    model, options = name.split(":")
    out = {"name": name, "step_s": [], "error": None}
    t0 = time.perf_counter()
    try:
        adapter, _, _ = random_adapter(model, device)
        cfg = train_config(parse(options), text_len, rank, 1)
        den, named = prepare_denoiser(adapter, cfg, stream=False)
        den.train()
        params = list(named.values())
        out["matmul"] = matmul_path(stored_as(cfg.model), "bfloat16", w8a8.resolve(cfg.model))
        latents, text = batch_inputs(model, dict(den.config), 1024, text_len)
        latents = latents.to(device)
        text = {k: v.to(device) for k, v in text.items()}
        opt = make_optimizer(TRAIN_CFG, params)
        scheduler = FlowMatchEulerDiscreteScheduler()
        out["build_s"] = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            out["resident_gib"] = torch.cuda.memory_allocated() / GIB
        for step in range(steps):
            t = time.perf_counter()
            train_step(adapter, den, params, opt, scheduler, latents, text, [torch.Generator().manual_seed(step)])
            if cuda:
                torch.cuda.synchronize()
            out["step_s"].append(time.perf_counter() - t)
            print(f"  {name}: step {step + 1}/{steps} {out['step_s'][-1]:.2f} s", flush=True)
    except Exception as e:  # recorded (an OOM too); the next row still runs
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        out["traceback"] = traceback.format_exc()[-3000:]
        out["oom"] = isinstance(e, torch.OutOfMemoryError)
    if cuda:
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        out["device"] = torch.cuda.get_device_name()
    out["step_median_s"] = statistics.median(out["step_s"][1:] or out["step_s"]) if out["step_s"] else None
    out["seconds"] = time.perf_counter() - t0
    return out


def committed(names) -> dict:
    """The rows of bench/memory.json by name (their CPU peak and preflight)."""
    rows = json.loads((HERE / "memory.json").read_text())["configs"]
    return {r["name"]: r for r in rows if r["name"] in set(names)}


def _child(name: str, steps: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        argv = [sys.executable, "-m", "bench.memory_gpu", "--row", name, "--row-out", str(out), "--steps", str(steps)]
        try:
            proc = subprocess.run(argv, cwd=HERE.parent, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return {"name": name, "error": f"timed out after {timeout:.0f} s", "traceback": str(e.stdout)[-2000:]}
        sys.stdout.write(proc.stdout)
        if out.is_file():
            return json.loads(out.read_text())
        return {"name": name, "error": f"exit {proc.returncode}", "traceback": (proc.stdout + proc.stderr)[-3000:]}


def run(names: list[str], steps: int, budget: float, out: Path) -> dict:
    import torch

    t0, rows = time.perf_counter(), []
    cpu = committed(names)
    doc = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": steps, "rows": rows}
    for name in names:
        left = budget - (time.perf_counter() - t0)
        if left < 30:
            rows.append({"name": name, "error": "not run: the budget was spent"})
            continue
        print(f"{name} ...", flush=True)
        r = _child(name, steps, left)
        ref = cpu.get(name, {})
        r.update(cpu_peak_gib=ref.get("peak_gib"), preflight_gib=ref.get("preflight_gib"))
        if r.get("gpu_peak_gib") and not r.get("error") and ref.get("preflight_gib"):
            r["preflight_error"] = ref["preflight_gib"] / r["gpu_peak_gib"] - 1
            r["cpu_peak_error"] = ref["peak_gib"] / r["gpu_peak_gib"] - 1
        rows.append(r)
        doc["seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"  {name}: peak {r.get('gpu_peak_gib') or float('nan'):.2f} GiB (CPU peak {ref.get('peak_gib') or float('nan'):.2f}, "
              f"preflight {ref.get('preflight_gib') or float('nan'):.2f}) step {r.get('step_median_s') or float('nan'):.1f} s "
              f"{r.get('error') or ''}", flush=True)
    doc["seconds"] = time.perf_counter() - t0
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def merge(results: Path, memory: Path = HERE / "memory.json") -> int:
    """The GPU figures of `results` into `memory`'s rows of the same name (rows that ran without an error)."""
    res = json.loads(Path(results).read_text())
    doc = json.loads(memory.read_text())
    by_name = {r["name"]: r for r in res["rows"] if r.get("gpu_peak_gib") and not r.get("error")}
    n = 0
    for row in doc["configs"]:
        r = by_name.get(row["name"])
        if r:
            row.update(gpu_peak_gib=r["gpu_peak_gib"], gpu_reserved_gib=r.get("gpu_reserved_gib"),
                       gpu_step_s=r.get("step_median_s"), gpu_device=r.get("device", res.get("device")),
                       gpu_date=res.get("date"), gpu_preflight_error=row["preflight_gib"] / r["gpu_peak_gib"] - 1)
            n += 1
    memory.write_text(json.dumps(doc, indent=1, default=list))
    print(f"merged {n} row(s) into {memory}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(PRIORITY), help="comma list of bench.memory family rows, in the "
                    "order to run (default: the image-to-video rows, each model's 24 GB setting first)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds: no row is started with under 30 left")
    ap.add_argument("--out", default=None, help="default bench/memory_gpu.json")
    ap.add_argument("--merge", default=None, help="a results file to merge into bench/memory.json (no GPU needed)")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.merge:
        return merge(Path(args.merge))
    if args.row:  # one row in this process, for run()'s parent
        Path(args.row_out).write_text(json.dumps(measure(args.row, args.steps), default=str))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench.memory_gpu needs a CUDA GPU (the CPU figures of these rows: python -m bench.memory --families)",
              file=sys.stderr)
        return 2
    from bench.memory_families import ROWS

    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        print(f"--only: not bench.memory family rows: {unknown}", file=sys.stderr)
        return 2
    run(names, args.steps, args.budget, Path(args.out or HERE / "memory_gpu.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
