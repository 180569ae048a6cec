"""Hydra sweeps (`-m`): members share the store's caches, and flows.sweep writes a summary of them."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf
from conftest import cli_env

REPO = Path(__file__).resolve().parents[1]


def test_sweep_shares_caches_and_writes_a_summary(tmp_path, prefect_api):
    data, prompts, sweep = tmp_path / "data", tmp_path / "prompts.txt", tmp_path / "sweep"
    shutil.copytree(REPO / "data" / "demo", data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)
    env = cli_env(tmp_path / "prefect-home")  # one process, one API for every member
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "-m", "train.lr=1e-3,2e-3", f"data.dir={data}",
         f"sample.prompts_file={prompts}", f"store.root={tmp_path / 'store'}", f"hydra.sweep.dir={sweep}",
         "train.max_steps=4", "train.log_every=2", "sample.steps=2"],
        cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    first, second = (json.loads((sweep / n / "report.json").read_text())["nodes"] for n in ("0", "1"))
    assert first["cache_latents"]["computed"] == 12
    assert second["cache_latents"]["computed"] == 0 and second["cache_latents"]["reused"] == 12
    assert second["cache_text"]["computed"] == 0
    assert first["train"]["status"] == second["train"]["status"] == "ran"
    assert first["train"]["key"] != second["train"]["key"]

    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["swept_keys"] == ["train.lr"]
    members = summary["members"]
    assert [m["member"] for m in members] == ["0", "1"]
    for m, lr in zip(members, ("0.001", "0.002")):
        assert m["status"] == "completed"
        assert any(o.startswith("train.lr=") and float(o.split("=")[1]) == float(lr) for o in m["swept"]), m
        assert isinstance(m["final_loss"], float)
        assert Path(m["lora"]).is_file() and Path(m["grid"]).is_file()
        assert m["report"] == str(sweep / m["member"] / "report.json")
    assert members[1]["nodes"]["cache_latents"]["computed"] == 0 and members[1]["nodes"]["train"]["status"] == "ran"
    md = (sweep / "summary.md").read_text()
    assert "train.lr=0.001" in md and "train.lr=0.002" in md and "0/report.json" in md
    _compared_by_eye(sweep, summary)


def _compared_by_eye(sweep: Path, summary: dict) -> None:
    """compare.png (a column per member, a row per prompt), loss.png, both in summary.md; one parent flow run
    `loraflow-sweep` with the members' flow runs under it, named and tagged, and the pictures as its artifacts."""
    from uuid import UUID

    from PIL import Image
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                FlowRunFilterTags)

    from flows.run_names import sweep_id
    from support import pictures

    member_grid = Image.open(next((sweep / "0" / "samples").glob("*_a_red_circle_on_a_blue_background.png")))
    cell = max(192, member_grid.width)  # tiny samples are shown at >= 192 px, as in the run's grid
    with Image.open(sweep / "compare.png") as compare:
        assert compare.width == 2 * cell + 4, compare.size  # two members, 4 px apart
        assert compare.height == 4 + 12 * 3 + 3 * (cell + 16), compare.size  # header, 3 prompts of label + cell
    assert Image.open(sweep / "loss.png").size == (800, 500)
    assert "](compare.png)" in (sweep / "summary.md").read_text() and "](loss.png)" in (sweep / "summary.md").read_text()
    assert summary["compare"] == str(sweep / "compare.png") and summary["loss_chart"] == str(sweep / "loss.png")

    tag = f"sweep:{sweep_id(sweep)}"
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
        parent, = [r for r in runs if r.name.startswith("sweep ")]
        assert parent.name == f"sweep {sweep_id(sweep)}: train.lr" and parent.state.is_completed()
        members = sorted((r for r in runs if r.id != parent.id), key=lambda r: r.name)
        assert [client.read_task_run(r.parent_task_run_id).flow_run_id for r in members] == [parent.id] * 2
        # family · data folder · the overrides as given (the swept one first here)
        assert [r.name.split(" · ")[2].split(" ")[0] for r in members] == ["lr=0.001", "lr=0.002"], [r.name for r in members]
        assert all({"family:flux", "loraflow-sweep", tag} <= set(r.tags) for r in members)
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[parent.id])))
    by_key = {a.key: a.data for a in found}
    (alt, compare), = pictures(by_key["loraflow-sweep-compare"])
    assert compare.size == Image.open(sweep / "compare.png").size and "train.lr=0.001; train.lr=0.002" in alt
    assert len(pictures(by_key["loraflow-sweep-loss"])) == 1 and len(pictures(by_key["loraflow-sweep-summary"])) == 2


def test_sweep_with_a_failing_member_summarises_it_and_exits_non_zero(tmp_path):
    """A member that fails on bad input (here a missing data.dir) does not stop the sweep: the others run,
    the summary lists it as failed with its error, and the sweep exits non-zero with one line, no traceback."""
    good, missing, sweep = tmp_path / "good", tmp_path / "missing", tmp_path / "sweep"
    shutil.copytree(REPO / "data" / "demo", good)
    env = cli_env(tmp_path / "prefect-home")
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "-m", f"data.dir={missing},{good}", f"store.root={tmp_path / 'store'}",
         f"hydra.sweep.dir={sweep}", "train.max_steps=4", "train.log_every=2", "sample.steps=2"],
        cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert [line for line in proc.stderr.splitlines() if "member(s) failed" in line] == [
        f"loraflow: sweep: 1 member(s) failed (0); errors in {sweep / 'summary.md'}"], proc.stderr[-3000:]

    summary = json.loads((sweep / "summary.json").read_text())
    failed, ok = summary["members"]
    assert (failed["member"], failed["status"]) == ("0", "failed")
    assert failed["error"].startswith("DatasetError: ") and str(missing) in failed["error"], failed
    assert failed["swept"] == [f"data.dir={missing}"]
    assert (ok["member"], ok["status"]) == ("1", "completed") and Path(ok["lora"]).is_file()
    assert summary["lowest_final_loss"]["member"] == "1"
    md = (sweep / "summary.md").read_text()
    assert "| 0 |" in md and "failed: DatasetError" in md and str(missing) in md and "1/report.json" in md


def _member(sweep: Path, n: str, overrides: list[str], loss: float | None) -> None:
    (sweep / n / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), sweep / n / ".hydra" / "overrides.yaml")
    if loss is not None:
        report = {"nodes": {"train": {"status": "ran", "key": n * 8, "computed": 1, "reused": 0, "seconds": 1.0}},
                  "artifacts": {"lora": str(sweep / n / "lora.safetensors"), "grid": None},
                  "loss": [{"step": 2, "loss": loss + 1}, {"step": 4, "loss": loss}]}
        (sweep / n / "report.json").write_text(json.dumps(report))


def test_summary_from_member_folders_as_a_parallel_launcher_leaves_them(tmp_path):
    """Launchers that run members in other processes: the callback sees no job ends, reads the folders."""
    from flows.sweep import SweepSummary

    sweep = tmp_path / "sweep"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)},
                                         "overrides": {"task": ["train.rank=4", "train.lr=1e-4,3e-4,1e-3"]}}})
    callback = SweepSummary()
    callback.on_multirun_start(config)
    for n, lr, loss in (("0", "0.0001", 0.7), ("1", "0.0003", 0.5), ("10", "0.001", None)):
        _member(sweep, n, ["train.rank=4", f"train.lr={lr}"], loss)
    callback.on_multirun_end(config)

    summary = json.loads((sweep / "summary.json").read_text())
    assert [m["member"] for m in summary["members"]] == ["0", "1", "10"]  # numeric order
    assert [m["swept"] for m in summary["members"]] == [["train.lr=0.0001"], ["train.lr=0.0003"], ["train.lr=0.001"]]
    assert summary["members"][0]["overrides"] == ["train.rank=4", "train.lr=0.0001"]
    assert [m["status"] for m in summary["members"]] == ["completed", "completed", "failed"]
    assert summary["members"][1]["final_loss"] == 0.5
    assert summary["lowest_final_loss"]["member"] == "1"
    assert "failed" in (sweep / "summary.md").read_text()


def test_compare_orders_members_by_objective_with_optuna_and_leaves_out_failed_ones():
    """hydra/sweeper=optuna: compare.png's columns run from the best objective (lowest) on; a failed member or
    one without a report has no column; launch order otherwise."""
    from flows.sweep_pictures import member_label, ordered

    members = [{"member": "0", "objective": 0.9, "report": "r0", "swept": ["train.lr=1e-4"]},
               {"member": "1", "status": "failed", "report": None},
               {"member": "2", "objective": 0.4, "report": "r2", "swept": ["train.lr=3e-4"]},
               {"member": "3", "objective": None, "report": "r3", "swept": []}]
    assert [m["member"] for m in ordered(members, by_objective=True)] == ["2", "0", "3"]
    assert [m["member"] for m in ordered(members, by_objective=False)] == ["0", "2", "3"]
    assert member_label(members[2]) == "#2: train.lr=3e-4" and member_label(members[3]) == "#3: (defaults)"
