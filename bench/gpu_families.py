"""Every family's whole DAG through the CLI, once per memory option, on whatever device torch finds (CUDA
when there is one): `python -m flows.train model=tiny_<family> ...` as a user types it, each run in its own
process with its own store and PREFECT_HOME (so each has its own ephemeral Prefect API), several at a time.

    python -m bench.gpu_families                       # every family x every variant; bench/gpu_families.json
    python -m bench.gpu_families --families flux,sd15 --variants bf16+ckpt --jobs 2
    python -m bench.gpu_families --variants cpu        # the runner itself on a machine without CUDA

A run is ok when the CLI exits 0, report.json shows all five nodes, its runtime is the expected device, every
logged loss is finite, every tensor of every exported LoRA file is finite and not all zero, and every sample
image has more than one pixel value (a NaN in fp16 decodes to a flat black image). The variant's first
run of each family is then run again unchanged and must be a no-op (every node after validate cached).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _families() -> tuple[str, ...]:
    """The registry's families (tasks/models/__init__.py), but the image-to-video ones: each of their sample prompts
    needs a first frame (--i), which no variant's prompts file here gives."""
    from tasks.models import FAMILIES as REGISTRY, adapter_class

    return tuple(f for f in REGISTRY if not adapter_class(f).controls.first_frame)


FAMILIES = _families()
# name -> overrides: each memory option a user of one GPU would pick (train.num_processes stays 1 = the GPUs
# of the lent machine; model.dtype=float16 trains under accelerate's fp16 loss scaling, tasks/training/train_setup.py)
VARIANTS = {
    "bf16+ckpt": ["train.mixed_precision=bf16", "train.gradient_checkpointing=true"],
    "fp16": ["model.dtype=float16", "train.mixed_precision=fp16"],
    "fp8+adamw8bit": ["model.storage_dtype=float8_e4m3fn", "train.optimizer=adamw8bit", "train.mixed_precision=bf16"],
    "cpu": [],  # the defaults: for checking this runner where there is no GPU
    # LoKr / LoHa (peft, applied in memory for sampling; the LyCORIS export), the latter with the masked-loss
    # path on (data.alpha_mask: the demo images have no alpha, so every mask is all ones)
    "lokr+bf16": ["train.network=lokr", "train.mixed_precision=bf16"],
    "loha+alpha_mask+bf16": ["train.network=loha", "data.alpha_mask=true", "train.mixed_precision=bf16"],
    # edit families (flux_kontext, flux2_*): each demo image its own control (data.control_dirs), and a sample
    # prompt with --i (bench/edit_prompts.txt)
    "edit+bf16": ["train.mixed_precision=bf16", f"data.control_dirs=[{REPO / 'data' / 'demo'}]",
                  f"sample.prompts_file={HERE / 'edit_prompts.txt'}"],
    # Qwen-Image-Edit: every sample prompt needs its image (--i)
    "edit-all+bf16": ["train.mixed_precision=bf16", f"data.control_dirs=[{REPO / 'data' / 'demo'}]",
                      f"sample.prompts_file={HERE / 'edit_prompts_all.txt'}"],
    # video families (wan, wan22): the demo clips (data/demo_clips, 17 frames at 64 px) and mp4 samples; needs
    # PyAV (`av`) on the device, which the GPU image lacks (bench/README.md: carried in a second call)
    "video+bf16": ["train.mixed_precision=bf16", "data=demo_clips", "data.frames=9",
                   f"sample.prompts_file={REPO / 'data' / 'demo_clips_prompts.txt'}"],
    # big bases (model.quantize, train.blocks_to_swap; the swap for the transformer families only)
    "nf4+ckpt": ["model.quantize=nf4", "model.dtype=bfloat16", "train.mixed_precision=bf16",
                 "train.gradient_checkpointing=true"],
    "int8+swap1+ckpt": ["model.quantize=int8", "model.dtype=bfloat16", "train.blocks_to_swap=1",
                        "train.mixed_precision=bf16", "train.gradient_checkpointing=true"],
    # the checkpointed block inputs in pinned host memory (save_on_cpu), any family
    "offload+ckpt": ["train.mixed_precision=bf16", "train.gradient_checkpointing=true",
                     "train.gradient_checkpointing_offload=true"],
    # Wan 2.2: one LoRA on both experts (tasks/models/wan22_experts.py), with the offload, on the demo clips
    "video+both+offload": ["train.mixed_precision=bf16", "data=demo_clips", "data.frames=9",
                           f"sample.prompts_file={REPO / 'data' / 'demo_clips_prompts.txt'}", "model.expert=both",
                           "train.gradient_checkpointing=true", "train.gradient_checkpointing_offload=true"],
}
COMMON = ["data.resolution=64", "train.max_steps=20", "train.log_every=5", "train.batch_size=2", "sample.steps=4"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_outputs(out: Path, expect_device: str) -> list[str]:
    """What is wrong with a finished run's directory (empty when nothing is)."""
    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file

    report_path = out / "report.json"
    if not report_path.is_file():
        return ["no report.json"]
    report = json.loads(report_path.read_text())
    problems = []
    nodes = report.get("nodes", {})
    missing = [n for n in ("validate", "cache_latents", "cache_text", "train", "sample") if n not in nodes]
    if missing:
        problems.append(f"nodes missing from the report: {missing}")
    device = report.get("runtime", {}).get("device")
    if device != expect_device:
        problems.append(f"report runtime.device is {device!r}, expected {expect_device!r}")
    bad_loss = [e for e in report.get("loss", []) if not math.isfinite(e["loss"])]
    if bad_loss:
        problems.append(f"non-finite losses: {bad_loss[:3]}")
    for fmt, path in report.get("artifacts", {}).get("lora_files", {}).items():
        tensors = load_file(path)
        if not tensors:
            problems.append(f"{fmt} LoRA file has no tensors")
        bad = [k for k, t in tensors.items() if not bool(t.float().isfinite().all())]
        if bad:
            problems.append(f"{fmt} LoRA file: {len(bad)} tensor(s) not finite, e.g. {bad[0]}")
        ups = [t for k, t in tensors.items() if "up" in k or "lora_B" in k]
        if ups and all(float(t.float().abs().max()) == 0.0 for t in ups):
            problems.append(f"{fmt} LoRA file: every up/B matrix is zero (nothing trained)")
    samples = report.get("artifacts", {}).get("samples", [])
    if not samples:
        problems.append("no samples")
    for s in samples:
        if s.endswith(".mp4"):  # a video family's sample: its frames
            from tasks.data.clips import inspect_clip, read_frames

            a = read_frames(s, inspect_clip(s)[1].frames)
        else:
            a = np.asarray(Image.open(s))
        if a.min() == a.max():
            problems.append(f"sample {Path(s).name} is a single flat value {a.min()}")
    return problems


def run_one(family: str, variant: str, root: Path, expect_device: str, rerun: bool, deadline: float,
            timeout: float) -> dict:
    run = root / f"{family}__{variant.replace('+', '_')}"
    run.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(run / "prefect"), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "flows.train", f"model=tiny_{family}", f"store.root={run / 'store'}",
           *COMMON, *VARIANTS[variant]]
    result = {"family": family, "variant": variant, "overrides": cmd[3:], "ok": False, "error": None}
    for attempt in ("first", "rerun") if rerun else ("first",):
        out = run / attempt
        t = time.perf_counter()
        left = min(timeout, deadline - t)
        if left < 15:
            result["error"] = f"{attempt} run: not started (--deadline reached)"
            return result
        try:
            proc = subprocess.run([*cmd, f"hydra.run.dir={out}"], cwd=REPO, env=env, capture_output=True,
                                  text=True, timeout=left)
            code, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            code, log = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        result[f"{attempt}_s"] = round(time.perf_counter() - t, 2)
        (run / f"{attempt}.log").write_text(log)
        if code != 0:
            result["error"] = f"{attempt} run: exit {code}"
            result["log_tail"] = log[-3000:]
            return result
        problems = check_outputs(out, expect_device)
        report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
        if attempt == "first":
            result["loss"] = report.get("loss", [])
            result["nodes_s"] = {n: e["seconds"] for n, e in report.get("nodes", {}).items()}
        else:
            ran = [n for n, e in report.get("nodes", {}).items() if n != "validate" and e["status"] != "cached"]
            if ran:
                problems.append(f"the unchanged re-run computed again: {ran}")
        if problems:
            result["error"] = f"{attempt} run: " + "; ".join(problems)
            result["log_tail"] = log[-3000:]
            return result
    result["ok"] = True
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_families", description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--variants", default="bf16+ckpt,fp16,fp8+adamw8bit", help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--jobs", type=int, default=4, help="CLI runs at a time")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per CLI run")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for everything: runs not done by then "
                    "are stopped and recorded as such (the results so far are written after every run)")
    ap.add_argument("--work", default=None, help="folder for the runs (default: a temporary folder, kept)")
    ap.add_argument("--out", default=str(HERE / "gpu_families.json"))
    ap.add_argument("--logs", default=None, help="also write every failed run's log tail to this file")
    args = ap.parse_args(argv)

    import tempfile

    import torch

    expect = "cuda" if _cuda() else "cpu"
    root = Path(args.work or tempfile.mkdtemp(prefix="loraflow-gpu-families-"))
    families, variants = args.families.split(","), args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [f for f in families if f not in FAMILIES]
    if unknown:
        print(f"unknown family or variant: {unknown}", file=sys.stderr)
        return 2
    jobs = [(f, v, i == 0) for i, v in enumerate(variants) for f in families]  # every family's first variant first
    device = torch.cuda.get_device_name(0) if expect == "cuda" else "cpu"
    print(f"bench.gpu_families: {len(jobs)} CLI runs on {device}, {args.jobs} at a time, in {root}", flush=True)
    t0 = time.perf_counter()
    deadline = t0 + (args.deadline or float("inf"))
    runs: list[dict] = []
    lock = threading.Lock()

    def write():
        fam = {f: {"ok": all(r["ok"] for r in runs if r["family"] == f) and
                   len([r for r in runs if r["family"] == f]) == len(variants),
                   "variants": {r["variant"]: r["ok"] for r in runs if r["family"] == f}} for f in families}
        doc = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "common_overrides": COMMON,
               "variants": {v: VARIANTS[v] for v in variants}, "families": fam, "runs": runs,
               "total_seconds": round(time.perf_counter() - t0, 1)}
        Path(args.out).write_text(json.dumps(doc, indent=1))
        if args.logs:
            Path(args.logs).write_text("\n\n".join(f"=== {r['family']} {r['variant']}: {r['error']}\n{r.get('log_tail', '')}"
                                                   for r in runs if not r["ok"]) or "all runs ok\n")
        return doc

    def go(job):
        f, v, rerun = job
        r = run_one(f, v, root, expect, rerun, deadline, args.timeout)
        print(f"  {f:<12} {v:<14} {'ok' if r['ok'] else 'FAILED: ' + str(r['error'])[:300]} "
              f"({r.get('first_s', 0):.0f} s)", flush=True)
        with lock:
            runs.append(r)
            write()
        return r

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(go, jobs))
    doc = write()
    print(f"{sum(r['ok'] for r in runs)}/{len(runs)} runs ok in {doc['total_seconds']:.0f} s; wrote {args.out}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
