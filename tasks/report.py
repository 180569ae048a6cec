"""The run report (contract.md): per-node status, key, counts, seconds and changed inputs; artifacts."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tasks.hashing import changed_inputs

NODES = ("validate", "cache_latents", "cache_text", "train", "sample")


def node_entry(result: dict, previous_inputs: dict | None) -> dict:
    return {"status": "cached" if result["computed"] == 0 else "ran", "key": result["key"],
            "computed": result["computed"], "reused": result["reused"], "seconds": round(result["seconds"], 3),
            "changed": changed_inputs(previous_inputs, result["inputs"]), "repaired": result.get("repaired", []),
            **({"continued_from_step": result["continued_from_step"]} if result.get("continued_from_step") else {})}


def write_report(run_dir: Path, report: dict) -> Path:
    path = run_dir / "report.json"
    tmp = run_dir / f".report.json.{os.getpid()}"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)
    return path
