"""Each run leaves Prefect artifacts: a markdown summary of the report, the loss table, LoRA and grid links."""
from __future__ import annotations

from pathlib import Path
from uuid import UUID



def test_run_publishes_artifacts(workspace):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.train import train_flow

    out = train_flow(config_name="train", overrides=workspace.overrides(["train.seed=21"]))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(out["flow_run_id"])])))
    by_key = {a.key: a for a in found}
    assert {"loraflow-report", "loraflow-loss", "loraflow-lora-diffusers", "loraflow-lora-kohya",
            "loraflow-samples"} <= set(by_key)
    summary = by_key["loraflow-report"].data
    assert "| train | ran |" in summary and "cache_latents" in summary and "report.json" in summary



def test_training_logs_loss_to_tensorboard(workspace):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = workspace.run("train.seed=22", "train.max_steps=6")
    assert report["nodes"]["train"]["status"] == "ran"
    event_file = next(Path(report["artifacts"]["tensorboard"]).rglob("events.out.tfevents.*"))
    events = EventAccumulator(str(event_file.parent))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 7))
    assert "lr" in events.Tags()["scalars"]
    # the per-step losses the report's windows (log_every=4) are made of
    values = [e.value for e in events.Scalars("loss")]
    # TensorBoard keeps each loss as the float32 it was (loss.item()): the same four numbers, the same mean
    assert report["loss"][0]["loss"] == sum(values[:4]) / 4
