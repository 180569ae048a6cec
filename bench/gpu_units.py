"""bench/gpu.py's units of work and how they run: each memory configuration, the train step against the bare
loop and latent caching against the bare loop. On CUDA each unit runs in its own process (`python -m bench.gpu
--unit NAME`), so a CUDA error (which poisons its process's context) costs that unit only. A unit that fails
with a CUDA error is run once more with CUDA_LAUNCH_BLOCKING=1 and one step, for the traceback of the kernel
that failed (the first such unit only), and once more with attention kept off cuDNN's kernel (--sdpa
no-cudnn), which is recorded beside the first attempt, never in its place. Then the preflight estimate of
each configuration and bench.memory's CPU-measured bytes are set beside the measured peaks."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIDE = ("train_step_vs_bare", "latents_vs_bare")


def _sdpa(choice: str):
    if choice != "no-cudnn":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def unit(name: str, args, arch: dict, device) -> dict:
    """One unit in this process."""
    from bench import flux_train as gpu  # the settings and their timed runs
    from bench.gpu_bare import latents_vs_bare, train_step_vs_bare

    with _sdpa(args.sdpa):
        for cname, fp8, ckpt, modulation in gpu.CONFIGS:
            if cname == name:
                print(f"{name} ...", flush=True)
                return gpu.run_config(name, fp8, ckpt, modulation, args, arch, device)
        print(f"{name} ...", flush=True)
        try:
            if name == "train_step_vs_bare":
                return train_step_vs_bare(arch, device, args.rank, args.resolution, args.text_len, args.bare_rounds,
                                          args.bare_steps)
            with tempfile.TemporaryDirectory() as tmp:
                return latents_vs_bare(Path(tmp), args.latent_images, args.resolution, 2 if args.tiny else 5)
        except Exception as e:  # recorded; the other units still run
            return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


def run_unit_here(args, arch: dict) -> int:
    """`python -m bench.gpu --unit NAME --unit-out FILE`: one unit, its result as JSON in FILE."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    Path(args.unit_out).write_text(json.dumps(unit(args.unit, args, arch, device), default=str))
    return 0


def _child(name: str, args, env: dict | None = None, extra: tuple = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "unit.json"
        argv = [sys.executable, "-m", "bench.gpu", "--unit", name, "--unit-out", str(out), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--batch", str(args.batch), "--rank", str(args.rank),
                "--resolution", str(args.resolution), "--text-len", str(args.text_len), "--bare-rounds",
                str(args.bare_rounds), "--bare-steps", str(args.bare_steps), "--latent-images",
                str(args.latent_images), "--sdpa", args.sdpa, *extra]
        proc = subprocess.run(argv, cwd=HERE.parent, env={**os.environ, **(env or {})}, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        if out.is_file():
            return json.loads(out.read_text())
        return {"config": name, "error": f"exit {proc.returncode}", "traceback": (proc.stdout + proc.stderr)[-4000:],
                "step_s": [], "step_median_s": None, "peak_gib": None, "oom": False}


def run_units(args, arch: dict, device, configs) -> tuple[list[dict], dict]:
    """(one result per configuration, {train_step_vs_bare, latents_vs_bare, figures})."""
    import time

    isolate = device.type == "cuda" and not args.in_process
    # the checkpointed configurations first (what users run), the no-checkpointing reference after them
    configs = sorted(configs, key=lambda c: not c[2])
    names = [c[0] for c in configs] + list(SIDE)
    results, diagnosed, t0 = {}, False, time.perf_counter()
    partial = Path(args.out).with_suffix(".partial.json") if getattr(args, "out", None) else None
    for name in names:
        r = _child(name, args) if isolate else unit(name, args, arch, device)
        late = args.budget and time.perf_counter() - t0 > args.budget / 2  # no time for retries
        if isolate and not late and r.get("error") and "CUDA error" in (r.get("error", "") + r.get("traceback", "")):
            if not diagnosed:  # where the kernel failed: synchronous launches, one step
                print(f"{name}: CUDA error; once more with CUDA_LAUNCH_BLOCKING=1 for its traceback", flush=True)
                diag = _child(name, args, {"CUDA_LAUNCH_BLOCKING": "1"}, ("--steps", "1", "--warmup", "0"))
                r["diagnosis"] = {"error": diag.get("error"), "traceback": diag.get("traceback")}
                diagnosed = True
            print(f"{name}: once more with attention off cuDNN (--sdpa no-cudnn)", flush=True)
            r["retry_no_cudnn"] = _child(name, args, None, ("--sdpa", "no-cudnn"))
        results[name] = r
        if partial:  # what is done so far, should the whole run be stopped
            partial.write_text(json.dumps(results, indent=1, default=str))
    rows = [results[c[0]] for c in configs]
    extra = {n: results[n] for n in SIDE}
    extra["figures"] = preflight(args, arch, configs, rows) + [
        {"name": n.replace("_", " "), "value": float(extra[n]["ratio"]) if "ratio" in extra[n] else float("nan"),
         "unit": "x", "goal": ("<= 1.05" if n == "train_step_vs_bare" else ">= 0.95"),
         "meets": bool(extra[n].get("meets"))} for n in SIDE]
    return rows, extra


def preflight(args, arch: dict, configs, rows: list[dict]) -> list[dict]:
    """The validate node's estimate and bench.memory's CPU-measured bytes beside each measured peak."""
    from bench.flux_train import LABELS
    from bench.memory import preflight as estimate, write_headers

    cpu = {} if args.tiny else {r["name"]: r["measured_gib"] for r in json.loads((HERE / "memory.json").read_text())["configs"]
                                if r.get("resolution") == args.resolution}
    figs = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_headers(Path(tmp), arch)
        for (name, fp8, ckpt, modulation), r in zip(configs, rows):
            est = estimate(folder, args.resolution, args.text_len, fp8, ckpt, modulation, args.rank)
            r["preflight_gib"], r["cpu_measured_gib"] = est["total_gb"], cpu.get(name)
            measured = r.get("peak_gib") if not r.get("error") else None
            if measured:
                r["preflight_error"] = est["total_gb"] / measured - 1
                figs.append({"name": f"{LABELS[name]}: preflight vs measured peak", "value": r["preflight_error"],
                             "unit": "relative", "goal": "within 10 %", "meets": abs(r["preflight_error"]) <= 0.10})
    return figs


def contract(device_name: str, results: list[dict], extra: dict, families_file: str | None) -> dict:
    """The keys contract.md fixes for bench/gpu_results.json."""
    families = {}
    if families_file:
        path = Path(families_file)
        families = json.loads(path.read_text())["families"] if path.is_file() else {"error": f"no {path}"}
    return {"device": device_name, "families": families,
            "configs": [{"name": r.get("config"), "step_s": r.get("step_median_s"), "peak_vram_gib": r.get("peak_gib"),
                         "preflight_gib": r.get("preflight_gib"), "preflight_error": r.get("preflight_error"),
                         "cpu_measured_gib": r.get("cpu_measured_gib"), "error": r.get("error")} for r in results],
            "train_step_vs_bare": extra.get("train_step_vs_bare", {}).get("ratio"),
            "latents_vs_bare": extra.get("latents_vs_bare", {}).get("ratio"), "side_by_side": extra}
