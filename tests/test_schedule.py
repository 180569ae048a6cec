"""The server's scheduler creates the scheduled deployment's runs and a worker completes them, with the
pinned server packages (SQLAlchemy 2.1 broke `schedule_deployments`: no scheduled run was ever created).

deploy/prefect.yaml's `retrain` is deployed from a copy whose schedule is due every minute and whose
parameters point at a temporary dataset and store (never the nightly schedule, never the repo's data).
The run's loraflow log is read back from the API, as `prefect flow-run logs` shows it.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import yaml

from conftest import FAST, REPO
from prefect_server import prefect_server

AUTH = "loraflow:test-secret"
POOL = "loraflow-pool"


def _scheduled_runs(server, deployment_id: str) -> list[dict]:
    r = server.request("POST", "/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [deployment_id]}},
                                                          "sort": "EXPECTED_START_TIME_ASC", "limit": 20})
    r.raise_for_status()
    return r.json()


def test_schedule_creates_runs_that_a_worker_completes(tmp_path):
    data, prompts, store, runs = tmp_path / "data", tmp_path / "prompts.txt", tmp_path / "store", tmp_path / "runs"
    shutil.copytree(REPO / "data" / "demo", data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)
    spec = yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())
    [retrain] = [d for d in spec["deployments"] if d["name"] == "retrain"]
    retrain["schedules"] = [{"cron": "* * * * *", "timezone": "UTC", "slug": "test-every-minute", "active": True}]
    retrain["parameters"]["overrides"] = [f"data.dir={data}", f"sample.prompts_file={prompts}", f"store.root={store}",
                                          f"hydra.run.dir={runs}/" + "${now:%H-%M-%S-%f}", *FAST]
    edited = tmp_path / "prefect.yaml"
    edited.write_text(yaml.safe_dump(spec, sort_keys=False))

    with prefect_server(tmp_path / "prefect", auth_string=AUTH,
                        server_settings={"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"}) as server:
        server.cli("work-pool", "create", POOL, "--type", "process")
        server.cli("work-pool", "set-concurrency-limit", POOL, "1")  # one run at a time on 2 cores
        server.cli("deploy", "--prefect-file", str(edited), "--name", "retrain")
        deployment = server.request("GET", "/deployments/name/loraflow/retrain").json()
        assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["* * * * *"]
        worker = server.start_worker(POOL)

        deadline = time.monotonic() + 180  # the scheduler's loop is 5 s here; generous for a loaded machine
        while not (scheduled := _scheduled_runs(server, deployment["id"])):
            assert time.monotonic() < deadline, f"the scheduler created no run\n{server.logs()}"
            assert worker.alive(), server.logs()
            time.sleep(2)
        first = scheduled[0]
        assert first["auto_scheduled"] is True, first  # made by the scheduler, not by hand
        run = server.wait_for(first["id"], timeout=420, watch=worker)  # due within a minute, then trained
        assert run["deployment_id"] == deployment["id"]
        server_log = server.processes[0].log.read_text(errors="replace")
        assert "InvalidRequestError" not in server_log, server.processes[0].tail()

        # loraflow's own log of that run, as `prefect flow-run logs <id>` reads it from the API
        logs = server.cli("flow-run", "logs", first["id"])
    [report_path] = list(runs.glob("*/report.json"))
    report = json.loads(report_path.read_text())
    assert report["nodes"]["train"]["status"] == "ran"
    for expected in ("validate: 12 images", "train: step", "ETA", "cache_latents:", "LoRA:", str(report_path)):
        assert expected in logs, f"{expected!r} not in `prefect flow-run logs`:\n{logs}"
    run_log = (report_path.parent / "loraflow.log").read_text()
    assert "validate: 12 images" in run_log and "report:" in run_log
    for proc in server.processes:
        assert not proc.members(), f"{proc.name} left processes behind"
