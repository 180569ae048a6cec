"""A sweep whose members run at the same time (Hydra's joblib launcher) against a real `prefect server` (the
test session's, conftest.shared_api_url): the members share one store, each completes, and every stored item
is valid with no temp debris left.

Parallel members cannot wait for each other's items, so both may compute the same latent: concurrent
writers of one key are safe (same key, same bytes; the first rename wins), which is what this checks."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from conftest import REPO, cli_env
from tasks.store import Store


def test_parallel_sweep_members_share_one_store(tmp_path):
    data, prompts, sweep, store = tmp_path / "data", tmp_path / "prompts.txt", tmp_path / "sweep", tmp_path / "store"
    shutil.copytree(REPO / "data" / "demo", data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)
    n_images = len(list(data.glob("*.png")))

    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "-m", "train.lr=1e-3,2e-3", "hydra/launcher=joblib",
         "hydra.launcher.n_jobs=2", f"data.dir={data}", f"sample.prompts_file={prompts}", f"store.root={store}",
         f"hydra.sweep.dir={sweep}", "train.max_steps=4", "train.log_every=2", "sample.steps=2"],
        cwd=REPO, env=cli_env(tmp_path / "prefect-home"), text=True, capture_output=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]

    reports = [json.loads((sweep / n / "report.json").read_text())["nodes"] for n in ("0", "1")]
    for nodes in reports:
        latents = nodes["cache_latents"]
        assert latents["computed"] + latents["reused"] == n_images
        assert nodes["train"]["status"] == "ran"
    # Between them the members computed each latent at least once and at most twice.
    assert n_images <= sum(r["cache_latents"]["computed"] for r in reports) <= 2 * n_images
    assert reports[0]["train"]["key"] != reports[1]["train"]["key"]

    s = Store(store)
    manifests = list(store.glob("*/*/*/manifest.json"))
    assert len(manifests) > n_images
    assert all(s.valid(m.parent.parent.parent.name, m.parent.name) for m in manifests)
    assert list((store / "tmp").iterdir()) == []  # no temp debris from either member
    summary = json.loads((sweep / "summary.json").read_text())
    assert [m["status"] for m in summary["members"]] == ["completed", "completed"]


def test_parallel_sweep_with_a_failing_member(tmp_path):
    """Members in joblib's worker processes: the failed one is listed from its folder (error.txt)."""
    data, missing, sweep = tmp_path / "data", tmp_path / "missing", tmp_path / "sweep"
    shutil.copytree(REPO / "data" / "demo", data)
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "-m", f"data.dir={missing},{data}", "hydra/launcher=joblib",
         "hydra.launcher.n_jobs=2", f"store.root={tmp_path / 'store'}", f"hydra.sweep.dir={sweep}",
         "train.max_steps=4", "train.log_every=2", "sample.steps=2"],
        cwd=REPO, env=cli_env(tmp_path / "prefect-home"), text=True, capture_output=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in output, output[-3000:]
    assert f"loraflow: sweep: 1 member(s) failed (0); errors in {sweep / 'summary.md'}" in proc.stderr.splitlines()
    failed, ok = json.loads((sweep / "summary.json").read_text())["members"]
    assert failed["status"] == "failed" and str(missing) in failed["error"], failed
    assert ok["status"] == "completed", ok
