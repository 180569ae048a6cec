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


def test_node_lines_give_a_difference_as_a_reason_only_for_computed_work(caplog):
    """A fully cached re-run after another config's run: each node's inputs differ from the last run of the
    config name (train.lr), yet nothing was computed; validate read the files, as every run does."""
    import logging
    from types import SimpleNamespace

    from flows.logs import LOGGER, log_nodes

    cfg = SimpleNamespace(sample=SimpleNamespace(prompts_file="prompts.txt"), data=SimpleNamespace(caption_extension=".txt"))
    nodes = {"validate": {"status": "ran", "computed": 12, "reused": 0, "seconds": 0.3, "changed": []},
             "train": {"status": "cached", "computed": 0, "reused": 1, "seconds": 0.1, "changed": ["train.lr"]},
             "sample": {"status": "ran", "computed": 3, "reused": 0, "seconds": 2.6, "changed": ["lora"]}}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log_nodes(nodes, cfg, "train")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].split() == ["validate:", "checked", "12", "items,", "0.3", "s"], lines
    assert lines[1].split() == ["train:", "cached", "(1", "reused),", "0.1", "s"], lines
    assert lines[2].endswith("3 computed, 0 reused, 2.6 s; differs from the last run of train: lora"), lines
