"""The Hydra CLI as users run it: a subprocess, its own ephemeral Prefect API, report where asked."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from conftest import prefect_home
from support import run_cli  # noqa: F401 (shared helpers, tests/support.py)

REPO = Path(__file__).resolve().parents[1]




def test_cli_runs_the_demo_and_writes_the_report(tmp_path):
    data = tmp_path / "my data"  # a space in the path on purpose
    shutil.copytree(REPO / "data" / "demo", data)
    run_dir = tmp_path / "run"
    proc = run_cli([f"data.dir={data}", f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}",
                 "train.max_steps=8", "train.log_every=4", "sample.steps=2"], REPO, tmp_path,
                   own_api=True)  # as `make run` runs: its own temporary API
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["nodes"]["train"]["status"] == "ran"
    assert Path(report["artifacts"]["lora"]).is_file()
    assert str(run_dir) in proc.stdout  # it tells the user where the outputs are
    assert "loss" in proc.stderr + proc.stdout


def test_cli_rejects_a_misspelt_key_before_any_work(tmp_path):
    proc = run_cli([f"store.root={tmp_path / 'store'}", "train.lrr=1e-4"], REPO, tmp_path)
    assert proc.returncode != 0
    assert "train.lrr" in proc.stderr
    assert not (tmp_path / "store").exists()
