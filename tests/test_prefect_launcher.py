"""`hydra/launcher=prefect`: sweep members as runs of the `loraflow/train` deployment, taken by the pool's
workers, against a real `prefect server start`, the pool and deployment from deploy/prefect.yaml and two
workers. The members with data complete and write their reports; those without fail on their worker, are
listed as failed with their flow run, and the command exits 1 with one line."""
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
             "hydra.launcher.poll_seconds=1", "train.lr=1e-3,2e-3", f"data.dir={data},{tmp_path / 'missing'}",
             f"sample.prompts_file={prompts}", f"store.root={store}", f"hydra.sweep.dir={sweep}",
             "train.max_steps=4", "train.log_every=2", "sample.steps=2"],
            cwd=REPO, env=server.env, text=True, capture_output=True, timeout=600)
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:] + server.logs()
        assert "Traceback" not in proc.stderr and "loraflow: sweep: 2 member(s) failed" in proc.stderr, proc.stderr[-3000:]
        assert all(w.alive() for w in workers)
        summary = json.loads((sweep / "summary.json").read_text())
        runs = {m["member"]: server.flow_run(m["flow_run_id"]) for m in summary["members"]}
        worker_logs = "\n".join(w.tail(200_000) for w in workers)

    by_member = {m["member"]: m for m in summary["members"]}
    ok = [n for n, m in by_member.items() if f"data.dir={data}" in m["overrides"]]
    failed = [n for n in by_member if n not in ok]
    assert len(ok) == 2 and len(failed) == 2, summary
    for member in ok:
        assert by_member[member]["status"] == "completed" and by_member[member]["state"] == "COMPLETED"
        report = json.loads((sweep / member / "report.json").read_text())
        assert report["nodes"]["train"]["status"] == "ran"
        run = runs[member]
        assert run["state"]["type"] == "COMPLETED"
        assert f"hydra.run.dir={sweep / member}" in run["parameters"]["overrides"]
    assert {o for n in ok for o in by_member[n]["swept"] if o.startswith("train.lr")} == {"train.lr=0.001", "train.lr=0.002"}
    for member in failed:  # failed on a worker: listed with its flow run and the reason
        m = by_member[member]
        assert m["status"] == "failed" and m["state"] == "FAILED" and runs[member]["state"]["type"] == "FAILED", m
        assert m["flow_run_id"] in m["error"] and "missing" in (runs[member]["state"]["message"] or ""), m
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
