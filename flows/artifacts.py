"""Prefect artifacts for a run: what the UI shows next to the flow run (a summary of the report, the
loss curve, links to the LoRA files and the sample grid). Never fatal: artifacts are a view."""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("loraflow")


def _table(report: dict) -> str:
    rows = ["| node | status | computed | reused | seconds | changed |", "|---|---|---|---|---|---|"]
    for name, n in report["nodes"].items():
        changed = ", ".join(n["changed"][:3]) + (" …" if len(n["changed"]) > 3 else "")
        rows.append(f"| {name} | {n['status']} | {n['computed']} | {n['reused']} | {n['seconds']:.1f} | {changed} |")
    return "\n".join(rows)


def summary_markdown(report: dict, report_path: Path) -> str:
    a = report["artifacts"]
    lines = [f"# loraflow run `{report['config_name']}`", "", _table(report), "",
             f"- report: `{report_path}`", f"- base model: `{a['base_model']}`"]
    lines += [f"- LoRA ({fmt}): `{path}`" for fmt, path in a["lora_files"].items()]
    if a.get("grid"):
        lines.append(f"- sample grid: `{a['grid']}`")
    if report["loss"]:
        lines.append(f"- loss: {report['loss'][0]['loss']:.4f} (step {report['loss'][0]['step']}) → "
                     f"{report['loss'][-1]['loss']:.4f} (step {report['loss'][-1]['step']})")
    if report["warnings"]:
        lines += ["", "## Warnings", *[f"- {w}" for w in report["warnings"]]]
    return "\n".join(lines)


def publish_artifacts(report: dict, report_path: Path) -> None:
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    try:
        create_markdown_artifact(key="loraflow-report", markdown=summary_markdown(report, report_path),
                                 description="loraflow run report")
        if report["loss"]:
            create_table_artifact(key="loraflow-loss", table=report["loss"], description="training loss")
        for fmt, path in report["artifacts"]["lora_files"].items():
            create_link_artifact(key=f"loraflow-lora-{fmt}", link=Path(path).as_uri(), link_text=f"LoRA ({fmt})")
        if report["artifacts"].get("grid"):
            create_link_artifact(key="loraflow-samples", link=Path(report["artifacts"]["grid"]).as_uri(),
                                 link_text="sample grid")
    except Exception as e:  # noqa: BLE001 -- a view of the run must not fail the run
        log.warning("could not publish Prefect artifacts: %s", e)


def sample_point_artifact(step: int, paths: list[str]) -> None:
    """The samples of one point during training, as they are rendered: one version of the artifact
    `loraflow-training-samples` per sample point (the UI lists them under the flow run)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import TaskRunContext

    if TaskRunContext.get() is None:  # not inside the train task (a test calling the node directly)
        return
    lines = [f"## Samples at training step {step}", "", *[f"- [{Path(p).name}]({Path(p).as_uri()})" for p in paths]]
    create_markdown_artifact(key="loraflow-training-samples", markdown="\n".join(lines),
                             description=f"samples at step {step}, {Path(paths[0]).parent}")
