"""`hydra/launcher=prefect`: sweep members as runs of the `loraflow/train` deployment, taken by the pool's
workers, against a real `prefect server start`, the pool and deployment from deploy/prefect.yaml and two
workers. Both members complete and write their reports; the summary lists each with its flow run."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from conftest import REPO
from prefect_server import prefect_server

POOL = "loraflow-pool"


def test_sweep_members_run_as_deployment_runs_on_two_workers(tmp_path):
    data, prompts, sweep, store = tmp_path / "data", tmp_path / "prompts.txt", tmp_path / "sweep", tmp_path / "store"
    shutil.copytree(REPO / "data" / "demo", data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)

    with prefect_server(tmp_path / "prefect", services={"scheduler": False}) as server:
        server.cli("work-pool", "create", POOL, "--type", "process")
        server.cli("deploy", "--prefect-file", "deploy/prefect.yaml", "--name", "train")
        workers = [server.start_worker(POOL, name=f"worker-{i}") for i in (1, 2)]
        proc = subprocess.run(
            [sys.executable, "-m", "flows.train", "-m", "hydra/launcher=prefect", "hydra.launcher.max_concurrent=2",
             "hydra.launcher.poll_seconds=1", "train.lr=1e-3,2e-3", f"data.dir={data}",
             f"sample.prompts_file={prompts}", f"store.root={store}", f"hydra.sweep.dir={sweep}",
             "train.max_steps=4", "train.log_every=2", "sample.steps=2"],
            cwd=REPO, env=server.env, text=True, capture_output=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:] + server.logs()
        assert all(w.alive() for w in workers)
        summary = json.loads((sweep / "summary.json").read_text())
        runs = {m["member"]: server.flow_run(m["flow_run_id"]) for m in summary["members"]}
        worker_logs = "\n".join(w.tail(200_000) for w in workers)

    assert [m["status"] for m in summary["members"]] == ["completed", "completed"], summary
    assert [m["state"] for m in summary["members"]] == ["COMPLETED", "COMPLETED"]
    for member in ("0", "1"):
        report = json.loads((sweep / member / "report.json").read_text())
        assert report["nodes"]["train"]["status"] == "ran"
        run = runs[member]
        assert run["state"]["type"] == "COMPLETED"
        assert f"hydra.run.dir={sweep / member}" in run["parameters"]["overrides"]
        assert f"train.lr={'0.001' if member == '0' else '0.002'}" in run["parameters"]["overrides"]  # Hydra's form
    assert {m["swept"][0] for m in summary["members"]} == {"train.lr=0.001", "train.lr=0.002"}
    assert "flow run `" in (sweep / "summary.md").read_text()
    # every member ran on a worker of the pool (not in the sweep's own process)
    assert all(m["flow_run_id"] in worker_logs for m in summary["members"]), worker_logs[-3000:]


def test_without_a_server_the_sweep_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run([sys.executable, "-m", "flows.train", "-m", "hydra/launcher=prefect", "train.lr=1e-3,2e-3",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "set PREFECT_API_URL" in proc.stderr
