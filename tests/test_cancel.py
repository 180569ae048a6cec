"""Cancelling a deployment's flow run (`prefect flow-run cancel`, the UI's stop button) with a real worker:
the worker sends SIGTERM to the flow-run process; training stops at the next step and stores a checkpoint of
the last finished step (whatever train.save_every_n_steps); the run ends Cancelled; a later run continues
from that checkpoint.

The SIGTERM behaviour (checkpoint on SIGTERM, exit 143) is built on branch h2 (issue 15); the assertions
marked [SIGTERM checkpoint] fail without it."""
from __future__ import annotations

import json
import shutil
import time

from conftest import REPO
from prefect_server import TERMINAL, prefect_server

POOL = "loraflow-pool"


def _checkpoint_steps(store) -> list[int]:
    steps = []
    for manifest in store.glob("checkpoints/*/*/manifest.json"):
        steps.append(json.loads(manifest.read_text())["meta"]["step"])
    return sorted(steps)


def test_cancel_stops_training_and_a_later_run_continues(tmp_path):
    data, prompts, store = tmp_path / "data", tmp_path / "prompts.txt", tmp_path / "store"
    shutil.copytree(REPO / "data" / "demo", data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)

    def overrides(run_dir, max_steps: int) -> str:
        return "overrides=" + json.dumps([f"data.dir={data}", f"sample.prompts_file={prompts}", f"store.root={store}",
                                          f"hydra.run.dir={run_dir}", f"train.max_steps={max_steps}", "train.log_every=5",
                                          "train.save_every_n_steps=0", "sample.steps=2"])

    with prefect_server(tmp_path / "prefect", services={"scheduler": False}) as server:
        server.cli("work-pool", "create", POOL, "--type", "process")
        server.cli("deploy", "--prefect-file", "deploy/prefect.yaml", "--name", "train")
        worker = server.start_worker(POOL)
        run1 = server.run_deployment("loraflow/train", "--param", overrides(tmp_path / "run1", 100_000))

        deadline = time.monotonic() + 300
        while "train: step" not in server.flow_run_logs(run1):  # training is under way (loraflow's log in the API)
            assert time.monotonic() < deadline and worker.alive(), server.logs()
            assert (server.flow_run(run1)["state"] or {}).get("type") not in TERMINAL, server.flow_run_logs(run1)
            time.sleep(1)
        server.cli("flow-run", "cancel", run1)

        deadline = time.monotonic() + 180
        while (state := (server.flow_run(run1)["state"] or {}).get("type")) not in TERMINAL:
            assert time.monotonic() < deadline and worker.alive(), f"{state}\n{server.flow_run_logs(run1)}\n{server.logs()}"
            time.sleep(1)
        logs = server.flow_run_logs(run1)
        assert state == "CANCELLED", f"{state}\n{logs}\n{server.logs()}"
        assert not (tmp_path / "run1" / "report.json").exists()  # stopped in training, long before step 100000
        deadline = time.monotonic() + 60  # the flow-run process is gone; the worker stays
        while (left := worker.members() - {worker.pid}) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left and worker.alive(), f"still running after cancel: {left}\n{server.logs()}"

        # [SIGTERM checkpoint] the last finished step is stored although save_every_n_steps=0
        steps = _checkpoint_steps(store)
        assert steps and steps[-1] < 100_000, ("no checkpoint after cancel: needs the SIGTERM handling of issue 15 "
                                               f"(branch h2)\n{logs}\n{server.logs()}")

        # [SIGTERM checkpoint] a later run continues from it: two more steps
        run2 = server.run_deployment("loraflow/train", "--param", overrides(tmp_path / "run2", steps[-1] + 2))
        server.wait_for(run2, timeout=300, watch=worker)
    report = json.loads((tmp_path / "run2" / "report.json").read_text())
    assert report["nodes"]["train"]["continued_from_step"] == steps[-1], report["nodes"]["train"]
