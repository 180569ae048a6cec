"""Run it the way users will: a real `prefect server start` with an API auth string, a process work pool,
`prefect deploy` from deploy/prefect.yaml, a `prefect worker start`, and `prefect deployment run`.

One server and one worker for the whole test (each costs seconds of CPU on a small machine). Every
process is started in its own process group through tests/prefect_server.py and stopped on the way out,
even when an assertion fails; the test then checks that none of them is left. The subprocesses get a
clean environment (their own PREFECT_HOME and PREFECT_API_URL), never the session's test API from
conftest.py.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import yaml
from PIL import Image

from conftest import FAST, REPO
from prefect_server import prefect_server

AUTH = "loraflow:test-secret"
POOL = "loraflow-pool"
PREFECT_YAML = REPO / "deploy" / "prefect.yaml"


class _Clock:
    """Prints how long each phase took (visible with -s): the test must stay lean on 2 cores."""

    def __init__(self):
        self.last = self.start = time.monotonic()

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        print(f"[test_deploy] {phase}: {now - self.last:.1f}s (total {now - self.start:.1f}s)", flush=True)
        self.last = now


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def _computed(report: dict) -> dict:
    return {n: (e["status"], e["computed"]) for n, e in report["nodes"].items()}


def test_deploy_file_declares_both_deployments():
    spec = yaml.safe_load(PREFECT_YAML.read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"train", "retrain"}
    for d in deployments.values():
        assert d["entrypoint"] == "flows/train.py:train_flow"
        assert d["work_pool"]["name"] == POOL
        assert d["work_pool"]["job_variables"]["env"]["HF_HUB_OFFLINE"] == "1"
        assert set(d["parameters"]) == {"config_name", "overrides"}
    assert [s["cron"] for s in deployments["retrain"]["schedules"]] == ["0 3 * * *"]
    assert "data.captions=auto" in deployments["retrain"]["parameters"]["overrides"]  # new images get captions
    assert not deployments["train"].get("schedules")


def test_deployments_run_on_a_worker(tmp_path):
    data, prompts, store = tmp_path / "data", tmp_path / "prompts.txt", tmp_path / "store"
    shutil.copytree(REPO / "data" / "demo", data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)
    n_images = len(list(data.glob("*.png")))
    yaml_before = PREFECT_YAML.read_bytes()
    clock = _Clock()

    def overrides(run_dir: Path, *extra: str) -> str:
        return "overrides=" + json.dumps([f"data.dir={data}", f"sample.prompts_file={prompts}",
                                          f"store.root={store}", f"hydra.run.dir={run_dir}", *FAST, *extra])

    # The scheduler service is off: the nightly schedule must not start a run (on the repo's default data)
    # if this test happens to run at 03:00 UTC. The schedule itself is checked through the API.
    with prefect_server(tmp_path / "prefect", auth_string=AUTH, services={"scheduler": False}) as server:
        clock("server start")
        # --- the API asks for the auth string ---------------------------------------------------------
        assert server.request("GET", "/health", auth=False).status_code == 200  # probes stay open
        assert server.request("POST", "/flows/filter", auth=False).status_code in (401, 403)
        assert server.request("POST", "/flows/filter", auth=False,
                              headers={"Authorization": "Basic d3Jvbmc="}).status_code in (401, 403)
        assert server.request("POST", "/flows/filter").status_code == 200

        # --- pool, deployments, worker: the commands docs/prefect.md gives ---------------------------------
        server.cli("work-pool", "create", POOL, "--type", "process")
        clock("auth checks, work-pool create")
        server.cli("deploy", "--all", "--prefect-file", "deploy/prefect.yaml")
        clock("prefect deploy --all")
        assert PREFECT_YAML.read_bytes() == yaml_before, "prefect deploy rewrote deploy/prefect.yaml"
        worker = server.start_worker(POOL)

        train = server.request("GET", "/deployments/name/loraflow/train").json()
        retrain = server.request("GET", "/deployments/name/loraflow/retrain").json()
        for d in (train, retrain):
            assert d["entrypoint"] == "flows/train.py:train_flow" and d["work_pool_name"] == POOL
            assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory":
                                        {"directory": str(REPO)}}]
            assert d["job_variables"]["env"] == {"HF_HUB_OFFLINE": "1"}
        assert train["schedules"] == []
        [nightly] = retrain["schedules"]
        assert nightly["schedule"]["cron"] == "0 3 * * *" and nightly["active"] is True

        # --- 1. train on demand: every node computes ----------------------------------------------------
        run1 = server.run_deployment("loraflow/train", "--param", overrides(tmp_path / "run1"))
        # while it runs: the schedule can be listed and paused from the CLI
        listed = json.loads(server.cli("deployment", "schedule", "ls", "loraflow/retrain", "-o", "json"))
        assert [(s["id"], s["active"]) for s in listed] == [(nightly["id"], True)]
        server.cli("deployment", "schedule", "pause", "loraflow/retrain", nightly["id"])
        paused = server.request("GET", "/deployments/name/loraflow/retrain").json()["schedules"]
        assert [s["active"] for s in paused] == [False]
        # ... and changed by editing the cron in prefect.yaml and deploying again (here: an edited copy).
        # Deploying replaces the deployment's schedules with the file's, `active: true` included, so it
        # also undoes the pause: pause for good with `active: false` in the file.
        edited = tmp_path / "prefect.yaml"
        edited.write_text(yaml_before.decode().replace('cron: "0 3 * * *"', 'cron: "30 4 * * 1-5"'))
        server.cli("deploy", "--prefect-file", str(edited), "--name", "retrain")
        [changed] = server.request("GET", "/deployments/name/loraflow/retrain").json()["schedules"]
        assert changed["schedule"]["cron"] == "30 4 * * 1-5" and changed["slug"] == "nightly", changed
        assert changed["active"] is True, changed
        flow_run = server.wait_for(run1, timeout=300, watch=worker)
        clock("run 1 (train, all computed; schedule ls, pause, redeploy meanwhile)")
        assert flow_run["deployment_id"] == train["id"]
        report = _report(tmp_path / "run1")
        assert report["nodes"]["cache_latents"]["computed"] == n_images == 12, _computed(report)
        assert report["nodes"]["train"]["status"] == "ran", _computed(report)
        assert report["nodes"]["sample"]["computed"] >= 1, _computed(report)
        assert Path(report["artifacts"]["lora"]).is_file()

        # --- 2. the retrain deployment on the same data and store: everything is cached ---------------
        run2 = server.run_deployment("loraflow/retrain", "--param", overrides(tmp_path / "run2"))
        assert server.wait_for(run2, timeout=240, watch=worker)["deployment_id"] == retrain["id"]
        clock("run 2 (retrain, all cached)")
        report = _report(tmp_path / "run2")
        nodes = report["nodes"]
        assert all(nodes[n]["computed"] == 0 for n in ("cache_latents", "cache_text", "sample")), _computed(report)
        assert all(nodes[n]["status"] == "cached" for n in ("cache_latents", "cache_text", "train", "sample"))

        # --- 3. one image + caption added: only those are encoded, and train reruns -------------------
        image = Image.open(data / "img_00.png").convert("RGB")
        image.putpixel((0, 0), tuple(255 - c for c in image.getpixel((0, 0))))
        image.save(data / "img_new.png")
        (data / "img_new.txt").write_text("a new red circle on a blue background\n")
        run3 = server.run_deployment("loraflow/retrain", "--param", overrides(tmp_path / "run3"))
        server.wait_for(run3, timeout=240, watch=worker)
        clock("run 3 (retrain, one image + caption added)")
        report = _report(tmp_path / "run3")
        nodes = report["nodes"]
        assert nodes["cache_latents"]["computed"] == 1 and nodes["cache_latents"]["reused"] == n_images, _computed(report)
        assert nodes["cache_text"]["computed"] == 1, _computed(report)
        assert nodes["train"]["status"] == "ran", _computed(report)

        # --- 4. images dropped in without captions (retrain's data.captions=auto): captioned, then trained -----
        for name in ("img_drop1.png", "img_drop2.png"):
            image.rotate(90 if name.endswith("1.png") else 180).save(data / name)
        captions_before = {p.name: p.read_bytes() for p in data.glob("*.txt")}
        run4 = server.run_deployment("loraflow/retrain", "--param", overrides(
            tmp_path / "run4", "data.captions=auto", "caption.model=tiny_vlm", "caption.max_new_tokens=8"))
        server.wait_for(run4, timeout=300, watch=worker)
        clock("run 4 (retrain, two images without captions)")
        report = _report(tmp_path / "run4")
        nodes = report["nodes"]
        assert (nodes["caption"]["computed"], nodes["caption"]["captions"]["hand_written"]) == (2, n_images + 1)
        assert nodes["cache_latents"]["computed"] == 2 and nodes["train"]["status"] == "ran", _computed(report)
        assert {p.name for p in (tmp_path / "run4" / "captions").glob("*.txt")} == {"img_drop1.txt", "img_drop2.txt"}
        assert {p.name: p.read_bytes() for p in data.glob("*.txt")} == captions_before  # the folder: untouched

    clock("stop worker and server (" + ", ".join(f"{p.name} {p.stop_seconds:.1f}s" for p in server.processes) + ")")
    # --- every process started for the test is gone (stopped by prefect_server's finally) ------------
    assert {p.name for p in server.processes} == {"server", "worker"}
    for proc in server.processes:
        assert proc.popen.returncode is not None, f"{proc.name} still running"
        assert not proc.members(), f"{proc.name} left processes behind: {proc.members()}"
