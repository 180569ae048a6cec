"""A sweep as one parent flow run (`loraflow-sweep`): `python -m flows.train -m ...` runs Hydra's sweep inside
it, so each member's flow run (Hydra's basic launcher and the Optuna sweeper run them in this process) is a
subflow under it in Prefect's UI. With `hydra/launcher=prefect` (deployment runs) or joblib (other
processes) the members are linked to it by the tag `sweep:<id>` instead. The parent carries the sweep's
artifacts: summary, compare.png and loss.png."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("loraflow")


def run_sweep(hydra_main, failed_members) -> None:
    """Runs `hydra_main` (the CLI's Hydra app, in -m mode) inside the parent flow run; its exit code (Ctrl-C,
    a failed sweep) is raised again outside the flow, so Prefect's engine never logs it as a crash.
    `failed_members()`: the members that failed, once the sweep is done (the parent then ends Failed)."""
    from prefect import flow
    from prefect.states import Failed

    exit_code: list = []
    started: list = []

    @flow(name="loraflow-sweep", persist_result=False)
    def loraflow_sweep(argv: list[str]):
        started.append(True)
        try:
            hydra_main()
        except SystemExit as e:
            if e.code not in (None, 0):
                exit_code.append(e.code)
                return Failed(message=f"the sweep stopped (exit {e.code})")
        if failed := failed_members():
            return Failed(message=f"{len(failed)} member(s) failed: " + ", ".join(m["member"] for m in failed))
        return None

    try:
        loraflow_sweep(list(sys.argv[1:]), return_state=True)
    except Exception as e:  # noqa: BLE001 -- no API to hold the parent: the members say why, one by one
        if started:
            raise
        log.warning("the sweep runs without a parent flow run (%s: %s)", type(e).__name__, e)
        hydra_main()
    if exit_code:
        sys.exit(exit_code[0])


def _in_flow() -> bool:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx is not None and ctx.flow_run is not None and ctx.flow.name == "loraflow-sweep"


def name_parent(sweep_dir: str, swept: list[str]) -> None:
    """The parent flow run named after the sweep (`sweep <id>: <swept keys>`) and tagged `sweep:<id>`."""
    if not _in_flow():
        return
    from flows.run_names import name_this_run, sweep_id

    sid = sweep_id(sweep_dir)
    name_this_run(f"sweep {sid}: {', '.join(swept) or 'no swept keys'}", ["loraflow", "loraflow-sweep", f"sweep:{sid}"])


def publish(summary: dict, markdown: str) -> None:
    """The sweep's artifacts on the parent flow run: the summary (`markdown`, its pictures inline) and each
    picture."""
    if not _in_flow():
        return
    from prefect.artifacts import create_markdown_artifact

    from flows.artifacts import image_markdown

    try:
        create_markdown_artifact(key="loraflow-sweep-summary", markdown=markdown,
                                 description=f"sweep summary ({Path(summary['sweep_dir']) / 'summary.md'})")
        if summary.get("compare"):
            members = [m for m in summary["members"] if m.get("status") != "failed"]
            create_markdown_artifact(
                key="loraflow-sweep-compare", description="the members' samples side by side (compare.png)",
                markdown="\n".join(["## Members side by side", "",
                                    image_markdown(summary["compare"], "members' samples side by side: " + "; ".join(
                                        " ".join(m.get("swept") or m["overrides"]) for m in members))]))
        if summary.get("loss_chart"):
            create_markdown_artifact(
                key="loraflow-sweep-loss", description="the members' loss curves (loss.png)",
                markdown="## Loss per member\n\n" + image_markdown(summary["loss_chart"], "members' loss curves")
                + "\n\nEach point is the mean of a log window of train.log_every steps.")
    except Exception as e:  # noqa: BLE001 -- a view of the sweep
        log.warning("could not publish the sweep's artifacts: %s", e)

