"""`hydra/sweeper=optuna` (hydra-optuna-sweeper): each trial is a member that returns its objective (the last
validation loss, else the final training loss); the sampler is seeded, so the same command proposes the same
trials; members share the store as grid sweeps do; the summary names the best trial, as Optuna does."""
from __future__ import annotations

import json
import subprocess
import sys

import yaml

from conftest import REPO, cli_env


def _sweep(tmp_path, name):
    env = cli_env(tmp_path / "prefect-home")
    proc = subprocess.run([sys.executable, "-m", "flows.train", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
                           "hydra.sweeper.n_jobs=1", "train.lr=interval(0.0005,0.005)", "train.max_steps=4",
                           "sample.steps=2", f"store.root={tmp_path / 'store'}", f"hydra.sweep.dir={tmp_path / name}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads((tmp_path / name / "summary.json").read_text())


def test_optuna_sweep_is_seeded_shares_caches_and_names_the_best_trial(tmp_path):
    first, second = _sweep(tmp_path, "first"), _sweep(tmp_path, "second")
    proposed = [[m["swept"] for m in s["members"]] for s in (first, second)]
    assert proposed[0] == proposed[1] and len(proposed[0]) == 2  # the same trials, in order
    assert proposed[0][0] != proposed[0][1]
    results = yaml.safe_load((tmp_path / "first" / "optimization_results.yaml").read_text())
    best = min(first["members"], key=lambda m: m["objective"])
    assert first["best"]["member"] == best["member"]
    assert results["best_value"] == best["objective"] == best["final_loss"]  # no validation split: training loss
    # the second sweep's members reuse the first's caches and LoRAs (same trials, same store)
    for m in second["members"]:
        assert m["nodes"]["cache_latents"]["computed"] == 0 and m["nodes"]["train"]["status"] == "cached", m
