"""A flow run's name and tags say what it trains: `train.run_name`, or the family, the data folder and the
overrides the user gave (`flux · photos · lr=3e-4 rank=16`); tags `family:<family>`, `model:<preset>`,
`experiment:<name>` and, for a sweep's members, `sweep:<sweep id>`. Prefect names a run at random before the
flow starts; the flow renames its own run once its config is composed. Never fatal: a name is a view."""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("loraflow")
MAX_NAME = 120  # characters: the UI's run list cuts long names anyway
_NOT_SHOWN = ("hydra.", "store.", "runner.", "data.dir=", "model=", "experiment=", "train.run_name=")


def _short(override: str) -> str:
    key, _, value = override.lstrip("+~").partition("=")
    key = key.removeprefix("train.")
    if "/" in value and not value.startswith(("http", "s3:", "gs:")):
        value = Path(value).name  # a path: its last part
    return f"{key}={value}"


def shown_overrides(overrides: list[str]) -> list[str]:
    """The overrides worth a name: the user's, without paths the name already shows or Hydra's own."""
    return [_short(o) for o in overrides if not o.lstrip("+~").startswith(_NOT_SHOWN)]


def _experiment(overrides: list[str]) -> str | None:
    named = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")]
    return named[-1] if named else None


def run_name(cfg, overrides: list[str]) -> str:
    if cfg.train.run_name:
        return str(cfg.train.run_name)[:MAX_NAME]
    data = Path(str(cfg.data.dir)).name if cfg.data.dir else "subsets"
    parts = [cfg.model.family, data]
    if experiment := _experiment(overrides):
        parts.insert(0, experiment)
    if shown := shown_overrides(overrides):
        parts.append(" ".join(shown))
    name = " · ".join(parts)
    return name if len(name) <= MAX_NAME else name[:MAX_NAME - 1] + "…"


def run_tags(cfg, overrides: list[str], sweep: str | None) -> list[str]:
    tags = ["loraflow", f"family:{cfg.model.family}", f"model:{cfg.model.name}"]
    if experiment := _experiment(overrides):
        tags.append(f"experiment:{experiment}")
    if sweep:
        tags += ["loraflow-sweep", f"sweep:{sweep}"]
    return tags


def sweep_id(sweep_dir: str | Path) -> str:
    """A sweep's tag: its folder's last two parts (Hydra's default `multirun/<date>/<time>` -> `<date>/<time>`)."""
    parts = Path(sweep_dir).parts
    return "/".join(parts[-2:])


def name_this_run(name: str, tags: list[str]) -> None:
    """Renames the current flow run and adds `tags` to the ones it has."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    for noisy in ("httpx", "httpcore"):  # Hydra's logging config turns INFO on for every library
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        run = FlowRunContext.get().flow_run  # the engine's copy: one request (the update), not two
        merged = list(dict.fromkeys([*(run.tags or []), *tags]))
        with get_client(sync_client=True) as client:
            client.update_flow_run(run.id, name=name, tags=merged)
    except Exception as e:  # noqa: BLE001
        log.warning("could not name the flow run: %s", e)
