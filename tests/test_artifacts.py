"""Each run leaves Prefect artifacts: a markdown summary of the report, the loss table, LoRA and grid links."""
from __future__ import annotations

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
