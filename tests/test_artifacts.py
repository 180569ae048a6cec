"""Each run leaves Prefect artifacts a person can look at from any browser: the report, the sample grid and the
loss chart as pictures inside the artifact (data URLs), the LoRA files as links (export.files_url) or paths,
a progress artifact of the training steps; and the flow run is named and tagged after what it trains."""
from __future__ import annotations

import re
from pathlib import Path
from uuid import UUID

from PIL import Image
from support import pictures



def _artifacts(flow_run_id: str) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)])))
    return {a.key: a for a in found}


def test_run_publishes_pictures_and_names_its_run(workspace):
    from prefect.client.orchestration import get_client

    from flows.train import train_flow

    out = train_flow(config_name="train", overrides=workspace.overrides(["train.seed=21", "train.rank=2"]))
    by_key = _artifacts(out["flow_run_id"])
    assert {"loraflow-report", "loraflow-loss", "loraflow-samples", "loraflow-lora-files",
            "loraflow-train-progress"} <= set(by_key), sorted(by_key)
    summary = by_key["loraflow-report"].data
    assert "| train | ran |" in summary and "cache_latents" in summary and "report.json" in summary
    assert re.search(r"loss \d\.\d{4} \(mean of steps 1-4\) → \d\.\d{4} \(mean of steps 9-12\)", summary), summary

    run_dir = Path(out["run_dir"])
    (alt, grid), = pictures(by_key["loraflow-samples"].data)
    with Image.open(run_dir / "samples" / "grid.png") as whole:  # the run folder's grid, narrower than 1280 px
        assert grid.size == whole.size and grid.convert("RGB").tobytes() == whole.convert("RGB").tobytes()
    assert "a red circle on a blue background · seed 0" in alt
    (_, chart), = pictures(by_key["loraflow-loss"].data)
    with Image.open(run_dir / "loss.png") as whole:
        assert chart.size == whole.size
    assert "mean of steps 9-12" in by_key["loraflow-loss"].data
    files = by_key["loraflow-lora-files"].data  # no export.files_url: paths, not file:// links
    assert str(run_dir / "lora" / "pytorch_lora_weights.safetensors") in files and "file://" not in files
    assert by_key["loraflow-train-progress"].data == 100.0

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(out["flow_run_id"]))
    assert run.name.startswith("flux · ") and "seed=21 rank=2" in run.name, run.name
    assert {"loraflow", "family:flux", "model:tiny_flux"} <= set(run.tags), run.tags


def test_lora_links_where_the_folder_is_served_and_a_given_run_name(workspace, monkeypatch):
    from prefect.client.orchestration import get_client

    from flows.train import train_flow

    monkeypatch.chdir(workspace.root)  # files_url serves the working directory; the run folder is under it
    out = train_flow(config_name="train", overrides=workspace.overrides(
        ["train.seed=23", "export.files_url=http://files.example:8000/", "train.run_name=my lora v2"]))
    by_key = _artifacts(out["flow_run_id"])
    rel = Path(out["run_dir"]).resolve().relative_to(workspace.root.resolve()).as_posix()
    assert by_key["loraflow-lora-diffusers"].data == \
        f"[LoRA (diffusers)](http://files.example:8000/{rel}/lora/pytorch_lora_weights.safetensors)"
    assert "loraflow-lora-kohya" in by_key and "loraflow-lora-files" not in by_key
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(UUID(out["flow_run_id"])).name == "my lora v2"


def test_files_url_must_be_http(workspace):
    from tasks.config import compose, resolve_paths
    from tasks.validate import config_errors

    cfg = resolve_paths(compose("train", workspace.overrides(["export.files_url=/srv/runs"]))[0])
    assert any(e.startswith("export.files_url=/srv/runs: not an http(s) URL") for e in config_errors(cfg))


def test_training_logs_loss_to_tensorboard(workspace):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = workspace.run("train.seed=22", "train.max_steps=6")
    assert report["nodes"]["train"]["status"] == "ran"
    # one run in TensorBoard's list: the settings are hparams of the folder with the losses, not of a subfolder
    folders = {f.parent for f in Path(report["artifacts"]["tensorboard"]).rglob("events.out.tfevents.*")}
    assert len(folders) == 1 and not [p for p in folders.copy().pop().iterdir() if p.is_dir()], folders
    events = EventAccumulator(str(folders.pop()))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 7))
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    hparams = events.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(hparams["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["max_steps"].number_value == 6 and start.hparams["optimizer"].string_value == "adamw"
    experiment = HParamsPluginData.FromString(hparams["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["loss"]  # the hparams table shows each run's loss
    assert "lr" in events.Tags()["scalars"]
    # the per-step losses the report's windows (log_every=4) are made of
    values = [e.value for e in events.Scalars("loss")]
    # TensorBoard keeps each loss as the float32 it was (loss.item()): the same four numbers, the same mean
    assert report["loss"][0]["loss"] == sum(values[:4]) / 4
