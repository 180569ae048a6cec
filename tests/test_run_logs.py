"""loraflow's own log reaches Prefect's API for the flow run (what `prefect flow-run logs` and the UI show)
and the run's `<run dir>/loraflow.log`. The deployment case is in tests/test_schedule.py."""
from __future__ import annotations

import asyncio

from conftest import FAST


def _api_logs(flow_run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
            return [x.message for x in logs]

    return asyncio.run(read())


def test_flow_run_logs_reach_the_api_and_the_run_folder(prefect_api, workspace):
    from flows.train import train_flow

    run_dir = workspace.root / "logged"
    out = train_flow(config_name="train", overrides=[*workspace.overrides(), f"hydra.run.dir={run_dir}",
                                                     "train.lr=7e-4", *FAST])
    logged = _api_logs(out["flow_run_id"])
    messages = "\n".join(logged)
    assert sum(m.startswith("report:") for m in logged) == 1, messages  # each record once
    for expected in ("validate: 12 images", "train: 12 steps", "loss", "ETA", "cache_latents:", "sample:",
                     "LoRA:", "report:", str(run_dir)):
        assert expected in messages, f"{expected!r} not in the API's logs:\n{messages}"
    text = (run_dir / "loraflow.log").read_text()
    for expected in ("validate: 12 images", "ETA", "LoRA:", "report:"):
        assert expected in text, text
    assert text.count("report:") == 1  # one handler per run, removed after it
