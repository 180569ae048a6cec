"""Prefect artifacts for a run: what the UI shows next to the flow run. Never fatal: artifacts are a view.

Pictures travel inside the artifact, as data URLs in markdown: Prefect 3.8's UI (the default, React one)
renders `![..](data:image/png;base64,..)` (its markdown sanitizer allows `data:image/` sources), so a browser
on any machine sees them, with nothing more to serve. A `file://` link does not open from an http page, and
an image artifact shows its URL as text under the picture (a data URL is ~100 KB of text). Files are links
only where `export.files_url` says where the run folder is served; otherwise their paths are listed."""
from __future__ import annotations

import base64
import io
import logging
import socket
from pathlib import Path

log = logging.getLogger("loraflow")
MAX_WIDTH = 1280  # px: a picture wider than this is shrunk for the UI (the file in the run folder is whole)
MAX_BYTES = 900_000  # a larger PNG goes as a JPEG: the artifact is a row in Prefect's database


def data_url(path: str | Path, max_width: int = MAX_WIDTH) -> str:
    """The image at `path` as a data URL, shrunk to `max_width`."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if im.width > max_width:
            im = im.resize((max_width, round(im.height * max_width / im.width)), Image.LANCZOS)
        buf = io.BytesIO()
        im.save(buf, format="PNG", optimize=True)
        kind = "png"
        if buf.tell() > MAX_BYTES:
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=85)
            kind = "jpeg"
    return f"data:image/{kind};base64,{base64.b64encode(buf.getvalue()).decode()}"


def _alt(text: str) -> str:
    return " ".join(text.replace("[", "(").replace("]", ")").split())


def image_markdown(path: str | Path, alt: str) -> str:
    return f"![{_alt(alt)}]({data_url(path)})"


def file_link(path: str | Path, files_url: str | None) -> str | None:
    """The http(s) address of a file under the folder `files_url` serves (the working directory), or None."""
    if not files_url:
        return None
    try:
        rel = Path(path).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return None
    return f"{files_url.rstrip('/')}/{rel.as_posix()}"


def loss_line(report: dict) -> str:
    """The first and last logged loss, each named as what it is: a mean over a window of steps."""
    loss = report.get("loss") or []
    if not loss:
        return ""
    first, last = loss[0], loss[-1]
    first_from = 1
    last_from = loss[-2]["step"] + 1 if len(loss) > 1 else 1
    return (f"loss {first['loss']:.4f} (mean of steps {first_from}-{first['step']}) → {last['loss']:.4f} "
            f"(mean of steps {last_from}-{last['step']})")


def _table(report: dict) -> str:
    rows = ["| node | status | computed | reused | seconds | changed |", "|---|---|---|---|---|---|"]
    for name, n in report["nodes"].items():
        changed = ", ".join(n["changed"][:3]) + (" …" if len(n["changed"]) > 3 else "")
        rows.append(f"| {name} | {n['status']} | {n['computed']} | {n['reused']} | {n['seconds']:.1f} | {changed} |")
    return "\n".join(rows)


def summary_markdown(report: dict, report_path: Path) -> str:
    a = report["artifacts"]
    lines = [f"# loraflow run `{report['config_name']}`", "", _table(report), "",
             f"- report: `{report_path}` (on {socket.gethostname()})", f"- base model: `{a['base_model']}`"]
    lines += [f"- LoRA ({fmt}): `{path}`" for fmt, path in a["lora_files"].items()]
    if a.get("grid"):
        lines.append(f"- sample grid: `{a['grid']}`")
    if a.get("loss_chart"):
        lines.append(f"- loss chart: `{a['loss_chart']}`")
    if line := loss_line(report):
        lines.append(f"- {line}")
    if report["warnings"]:
        lines += ["", "## Warnings", *[f"- {w}" for w in report["warnings"]]]
    return "\n".join(lines)


def samples_markdown(report: dict) -> str:
    a = report["artifacts"]
    labels = a.get("sample_labels") or []
    lines = ["## Samples", "", image_markdown(a["grid"], "sample grid: " + "; ".join(labels)), ""]
    lines += [f"{i}. {label}" for i, label in enumerate(labels, 1)]
    return "\n".join(lines)


def loss_markdown(report: dict) -> str:
    lines = ["## Training loss", "", image_markdown(report["artifacts"]["loss_chart"], "training loss per step, "
                                                    "its running mean and the learning rate")]
    if line := loss_line(report):
        lines += ["", line.capitalize() + "."]
    if report.get("validation_loss"):
        v = report["validation_loss"][-1]
        lines.append(f"Validation loss at step {v['step']}: {v['loss']:.4f} (held-out items).")
    return "\n".join(lines)


def files_markdown(report: dict) -> str:
    lines = ["## LoRA files", "", f"On `{socket.gethostname()}` (set `export.files_url` to get links):", ""]
    lines += [f"- {fmt}: `{path}`" for fmt, path in report["artifacts"]["lora_files"].items()]
    return "\n".join(lines)


def publish_artifacts(report: dict, report_path: Path, files_url: str | None = None) -> None:
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    a = report["artifacts"]
    try:
        create_markdown_artifact(key="loraflow-report", markdown=summary_markdown(report, report_path),
                                 description="loraflow run report")
        if a.get("loss_chart"):
            create_markdown_artifact(key="loraflow-loss", markdown=loss_markdown(report),
                                     description="training loss (loss.png)")
        if a.get("grid"):
            create_markdown_artifact(key="loraflow-samples", markdown=samples_markdown(report),
                                     description="samples after training (samples/grid.png)")
        links = {fmt: file_link(path, files_url) for fmt, path in a["lora_files"].items()}
        for fmt, link in links.items():
            if link:
                create_link_artifact(key=f"loraflow-lora-{fmt}", link=link, link_text=f"LoRA ({fmt})")
        if not all(links.values()):
            create_markdown_artifact(key="loraflow-lora-files", markdown=files_markdown(report),
                                     description="the LoRA files")
    except Exception as e:  # noqa: BLE001 -- a view of the run must not fail the run
        log.warning("could not publish Prefect artifacts: %s", e)


def _in_task() -> bool:
    from prefect.context import TaskRunContext

    return TaskRunContext.get() is not None


def sample_point_artifact(step: int, paths: list[str]) -> None:
    """The samples of one point during training, as they are rendered: one version of the artifact
    `loraflow-training-samples` per sample point (the UI lists them under the flow run)."""
    from prefect.artifacts import create_markdown_artifact

    if not _in_task():  # not inside the train task (a test calling the node directly)
        return
    try:
        pictures = [image_markdown(p, f"step {step}: {Path(p).stem}") for p in paths if Path(p).suffix == ".png"]
        lines = [f"## Samples at training step {step}", "", " ".join(pictures), "",
                 *[f"- `{Path(p).name}`" for p in paths]]
        create_markdown_artifact(key="loraflow-training-samples", markdown="\n".join(lines),
                                 description=f"samples at step {step}, {Path(paths[0]).parent}")
    except Exception as e:  # noqa: BLE001
        log.warning("could not publish the samples of step %d: %s", step, e)


class TrainingProgress:
    """Prefect's progress artifact of the train task, moved as steps finish (every 1 % at most)."""

    def __init__(self) -> None:
        self.id, self.shown, self.failed = None, -1.0, False

    def __call__(self, step: int, max_steps: int) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        if self.failed or not _in_task():  # an API that went away is tried once, not at every step
            return
        percent = round(100.0 * step / max(max_steps, 1), 0)
        if percent == self.shown:
            return
        try:
            if self.id is None:
                self.id = create_progress_artifact(percent, key="loraflow-train-progress",
                                                   description=f"training steps ({max_steps} in all)")
            else:
                update_progress_artifact(self.id, percent)
            self.shown = percent
        except Exception as e:  # noqa: BLE001
            log.warning("could not update the training progress (not tried again in this run): %s", e)
            self.failed = True

