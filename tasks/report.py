"""The run report (contract.md): per-node status, key, counts, seconds and changed inputs; artifacts."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tasks.hashing import changed_inputs

NODES = ("validate", "cache_latents", "cache_text", "train", "sample")


def node_entry(result: dict, previous_inputs: dict | None) -> dict:
    return {"status": "cached" if result["computed"] == 0 else "ran", "key": result["key"],
            "computed": result["computed"], "reused": result["reused"], "seconds": round(result["seconds"], 3),
            "changed": changed_inputs(previous_inputs, result["inputs"]), "repaired": result.get("repaired", [])}


def publish(run_dir: Path, lora_file: str, samples: list[str], prompts: list[dict]) -> dict:
    """Copy the run's outputs out of the store into its run directory (the store keeps the originals)."""
    from tasks.sample import make_grid, slug

    lora_dir = run_dir / "lora"
    lora_dir.mkdir(parents=True, exist_ok=True)
    lora = lora_dir / "pytorch_lora_weights.safetensors"  # the name diffusers' load_lora_weights(dir) looks for
    shutil.copyfile(lora_file, lora)
    out = run_dir / "samples"
    out.mkdir(exist_ok=True)
    paths = []
    for src, p in zip(samples, prompts):
        dst = out / f"{p['line']:03d}_{slug(p['prompt'])}.png"
        shutil.copyfile(src, dst)
        paths.append(str(dst))
    grid = str(make_grid([Path(p) for p in paths], out / "grid.png")) if paths else None
    return {"lora": str(lora), "lora_files": {"diffusers": str(lora)}, "samples": paths, "grid": grid,
            "checkpoint_samples": {}}


def write_report(run_dir: Path, report: dict) -> Path:
    path = run_dir / "report.json"
    tmp = run_dir / f".report.json.{os.getpid()}"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)
    return path
