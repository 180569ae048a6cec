"""A Hydra callback that summarises a sweep (`python -m flows.train -m train.lr=1e-4,3e-4,1e-3`).

Registered in conf/train.yaml under `hydra.callbacks`. After the last member it writes
`<hydra.sweep.dir>/summary.json` and `summary.md`: per member its overrides, final loss, LoRA file,
sample grid, report path and each node's status and counts (the caches shared across members show as
`computed 0` from the second member on).

Members run one after another in one process with Hydra's basic launcher, or as runs of a deployment
with `hydra/launcher=prefect` (hydra_plugins/loraflow_prefect_launcher). A parallel launcher
(hydra-joblib-launcher: `hydra/launcher=joblib`) runs them in worker processes; those must share one
Prefect API, because each process would otherwise start its own ephemeral API on the same SQLite file:
start `prefect server start` and export `PREFECT_API_URL=http://127.0.0.1:4200/api` first.

The summary is built from files, so it works with any launcher: each member's `report.json` and the
overrides Hydra saves in `<member dir>/.hydra/overrides.yaml`. A member that fails returns normally (so
Hydra runs the rest) after `member_failed` writes `<member dir>/error.txt`; the summary lists it as failed
with that error, and `python -m flows.train -m` then exits 1 with one line (`failed_members`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("loraflow")
ERROR_FILE = "error.txt"  # <member dir>/error.txt: why a member failed (one message), for the summary
FLOW_RUN_FILE = "flow_run.json"  # <member dir>/flow_run.json: {flow_run_id, state} (hydra/launcher=prefect)
failed_members: list[dict] = []  # set by SweepSummary.on_multirun_end: the sweep's failed members
summary_path: Path | None = None  # ... and its summary.md
NODES = ("validate", "cache_latents", "cache_text", "train", "sample")  # as tasks.report.NODES (kept light)


def _swept_keys(task_overrides: list[str]) -> list[str]:
    """Keys that the sweep varies (`train.lr=1e-4,3e-4`, `range(...)`, `choice(...)`, `glob(...)`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(task_overrides)
    except Exception:  # never let the summary break a finished sweep
        return []
    return [o.get_key_element() for o in parsed if o.is_sweep_override()]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("~+")


def _member_number(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)


def member_summary(out_dir: Path, overrides: list[str] | None, swept: list[str], status: str | None = None,
                   error: str | None = None) -> dict:
    """One member's line: overrides, final loss, LoRA, grid, report and node counts (from its report.json)."""
    if overrides is None:
        saved = out_dir / ".hydra" / "overrides.yaml"
        overrides = list(OmegaConf.to_container(OmegaConf.load(saved))) if saved.is_file() else []
    overrides = [o for o in overrides if not o.startswith("hydra.")]
    report_path = out_dir / "report.json"
    entry: dict[str, Any] = {"member": out_dir.name, "dir": str(out_dir), "overrides": overrides,
                             "swept": [o for o in overrides if _key(o) in swept]}
    try:
        report = json.loads(report_path.read_text())
    except (FileNotFoundError, ValueError):
        report = None
    flow_run = out_dir / FLOW_RUN_FILE  # hydra/launcher=prefect: the member's deployment run
    if flow_run.is_file():
        with contextlib.suppress(ValueError, OSError):
            entry.update({k: v for k, v in json.loads(flow_run.read_text()).items() if k in ("flow_run_id", "state")})
    error_file = out_dir / ERROR_FILE
    if error_file.is_file():  # the member's own record of its failure (any launcher)
        status, error = "failed", error or error_file.read_text().strip()
    if report is None:
        entry.update(status="failed", error=error or f"no report at {report_path}")
        return entry
    loss = report.get("loss") or []
    validation = report.get("validation_loss") or []
    artifacts = report.get("artifacts", {})
    nodes = report.get("nodes", {})
    if error:
        entry["error"] = error
    validation = report.get("validation_loss") or []
    entry.update(status=status or "completed", report=str(report_path),
                 final_loss=loss[-1]["loss"] if loss else None, objective=objective(report_path),
                 final_validation_loss=validation[-1]["loss"] if validation else None, lora=artifacts.get("lora"),
                 grid=artifacts.get("grid"), lora_key=nodes.get("train", {}).get("key"),
                 nodes={n: {k: nodes[n].get(k) for k in ("status", "computed", "reused", "seconds")}
                        for n in NODES if n in nodes})
    return entry


def objective(report_path: str | Path) -> float | None:
    """A member's score for hydra/sweeper=optuna (minimised): its last validation loss when the run has a
    validation split, else its final training loss (a window's mean, as logged)."""
    try:
        report = json.loads(Path(report_path).read_text())
    except (OSError, ValueError):
        return None
    curve = report.get("validation_loss") or report.get("loss") or []
    return float(curve[-1]["loss"]) if curve else None


def seed_optuna(argv: list[str], seed: int = 0) -> None:
    """`hydra/sweeper=optuna` proposes the same trials for the same command: its sampler is seeded (0)
    unless `hydra.sweeper.sampler.seed=` is given."""
    if any(a.replace("hydra/sweeper=", "", 1) == "optuna" for a in argv if a.startswith("hydra/sweeper=")) and \
            not any(a.startswith("hydra.sweeper.sampler.seed=") for a in argv):
        argv.append(f"hydra.sweeper.sampler.seed={seed}")


def member_failed(out_dir: str | Path, error: BaseException) -> dict:
    """A failed member: its error in `<member dir>/error.txt` (and the traceback, for an unexpected error, in
    `traceback.txt`), one line on stderr. The member returns normally, so the sweep goes on to the others."""
    import sys
    import traceback

    out_dir = Path(out_dir)
    message = f"{type(error).__name__}: {error}"
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / ERROR_FILE, message + "\n")
    if not isinstance(error, _user_errors()):
        _write(out_dir / "traceback.txt", "".join(traceback.format_exception(error)))
    print(f"loraflow: sweep member {out_dir.name} failed: {_one_line(message)}", file=sys.stderr)
    return {"failed": message}


def _user_errors() -> tuple[type, ...]:
    from flows.errors import USER_ERRORS

    return USER_ERRORS


def _one_line(text: str) -> str:
    return " ".join(text.split())


def summarise(sweep_dir: Path, members: list[dict], swept: list[str]) -> dict:
    ok = [m for m in members if m.get("final_loss") is not None]
    best = min(ok, key=lambda m: m["final_loss"]) if ok else None
    scored = [m for m in members if m.get("objective") is not None]
    best_trial = min(scored, key=lambda m: m["objective"]) if scored else None
    return {"sweep_dir": str(sweep_dir), "swept_keys": swept, "members": members,
            # the member with the lowest objective (validation loss where there is one): optuna's best trial
            "best": best_trial and {"member": best_trial["member"], "objective": best_trial["objective"],
                                    "overrides": best_trial["swept"] or best_trial["overrides"]},
            "lowest_final_loss": best and {"member": best["member"], "final_loss": best["final_loss"],
                                           "swept": best["swept"]}}


def _rel(path: str | None, base: Path) -> str:
    if not path:
        return ""
    try:
        return os.path.relpath(path, base)
    except ValueError:
        return path


def to_markdown(summary: dict, inline: bool = False) -> str:
    """summary.md; `inline`: its pictures as data URLs (for Prefect's UI: a relative link works only beside the
    file)."""
    base = Path(summary["sweep_dir"])

    def picture(path: str) -> str:
        if inline:
            from flows.artifacts import data_url

            return data_url(path)
        return _rel(path, base)
    lines = [f"# Sweep summary: {base}", "",
             f"Swept: {', '.join(summary['swept_keys']) or '(nothing)'}; {len(summary['members'])} member(s).", ""]
    if summary.get("compare"):
        lines += ["Samples side by side (a row per prompt, a column per member):", "",
                  f"![members' samples side by side]({picture(summary['compare'])})", ""]
    if summary.get("loss_chart"):
        lines += ["Loss curves (each point the mean of a log window of train.log_every steps):", "",
                  f"![members' loss curves]({picture(summary['loss_chart'])})", ""]
    lines += [
             "| member | overrides | final loss (mean of the last log window) | validation loss | LoRA | grid | report | " + " | ".join(NODES[1:]) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * (len(NODES) - 1)]
    for m in summary["members"]:
        shown = " ".join(f"`{o}`" for o in (m["swept"] or m["overrides"])) or "-"
        if m.get("flow_run_id"):
            shown += f" (flow run `{m['flow_run_id']}`, {m.get('state', '?')})"
        if m["status"] == "failed":
            lines.append(f"| {m['member']} | {shown} | failed: {_one_line(m.get('error', '')).replace('|', '/')} | | | | |" + " |" * (len(NODES) - 1))
            continue
        loss = f"{m['final_loss']:.4f}" if m["final_loss"] is not None else "-"
        val = f"{m['final_validation_loss']:.4f}" if m.get("final_validation_loss") is not None else "-"
        link = lambda p, label: f"[{label}]({_rel(p, base)})" if p else "-"  # noqa: E731
        counts = []
        for n in NODES[1:]:
            e = m["nodes"].get(n)
            counts.append(f"{e['status']} ({e['computed']} computed, {e['reused']} reused)" if e else "-")
        lines.append(f"| {m['member']} | {shown} | {loss} | {val} | {link(m['lora'], 'lora')} | {link(m['grid'], 'grid')} | "
                     f"{link(m['report'], 'report.json')} | " + " | ".join(counts) + " |")
    if summary.get("best") and any(m.get("final_validation_loss") is not None for m in summary["members"]):
        b = summary["best"]
        lines += ["", f"Lowest validation loss: member {b['member']} ({b['objective']:.4f}, {' '.join(b['overrides'])})."]
    best = summary["lowest_final_loss"]
    if best:
        lines += ["", f"Lowest final loss: member {best['member']} ({best['final_loss']:.4f}, "
                      f"{' '.join(best['swept']) or 'no swept overrides'})."]
    return "\n".join(lines) + "\n"


def _pictures(sweep_dir: Path, members: list[dict], by_objective: bool) -> dict:
    """compare.png and loss.png of the sweep (flows/sweep_pictures.py); never fatal."""
    from flows import sweep_pictures

    out = {}
    for name, make in (("compare", sweep_pictures.compare_png), ("loss_chart", sweep_pictures.loss_png)):
        try:
            path = make(members, sweep_dir / ("compare.png" if name == "compare" else "loss.png"), by_objective)
        except Exception as e:  # noqa: BLE001 -- the members' results stand without the picture
            log.warning("sweep summary: %s not drawn (%s: %s)", name, type(e).__name__, e)
            path = None
        if path:
            out[name] = str(path)
    return out


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class SweepSummary(Callback):
    """`on_multirun_end`: `<sweep dir>/summary.json` and `summary.md`.

    Members that ran in this process (basic launcher) are known from `on_job_end`; otherwise (a launcher
    running jobs elsewhere) the member folders of the sweep dir written since the sweep started are read."""

    def __init__(self) -> None:
        self.jobs: list[dict] = []
        self.started = time.time()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.jobs, self.started = [], time.time()
        with contextlib.suppress(Exception):  # the parent flow run (flows/cli.py) takes the sweep's name
            from flows import sweep_parent

            sweep_parent.name_parent(str(config.hydra.sweep.dir), _swept_keys(list(config.hydra.overrides.task)))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        try:
            status = getattr(job_return.status, "name", str(job_return.status)).lower()
            error = None
            value = job_return._return_value
            if status == "failed":
                error = f"{type(value).__name__}: {value}"
            elif isinstance(value, dict) and "failed" in value:  # member_failed
                status, error = "failed", value["failed"]
            self.jobs.append({"dir": str(config.hydra.runtime.output_dir), "overrides": list(job_return.overrides or []),
                              "status": status, "error": error})
        except Exception as e:  # a summary must never fail a job
            log.warning("sweep summary: could not record a member (%s)", e)

    def _members_on_disk(self, sweep_dir: Path) -> list[dict]:
        found = []
        for d in sweep_dir.iterdir() if sweep_dir.is_dir() else ():
            saved = d / ".hydra" / "overrides.yaml"
            if d.is_dir() and saved.is_file() and saved.stat().st_mtime >= self.started - 1:
                found.append({"dir": str(d), "overrides": None, "status": None, "error": None})
        return found

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
            swept = _swept_keys(list(config.hydra.overrides.task))
            jobs = self.jobs or self._members_on_disk(sweep_dir)
            jobs = sorted({j["dir"]: j for j in jobs}.values(), key=lambda j: _member_number(Path(j["dir"])))
            members = [member_summary(Path(j["dir"]), j["overrides"], swept,
                                      None if j["status"] in (None, "completed") else j["status"], j["error"])
                       for j in jobs]
            summary = summarise(sweep_dir, members, swept)
            sweep_dir.mkdir(parents=True, exist_ok=True)
            summary.update(_pictures(sweep_dir, members, "optuna" in str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))))
            _write(sweep_dir / "summary.json", json.dumps(summary, indent=2))
            _write(sweep_dir / "summary.md", to_markdown(summary))
            global summary_path
            failed_members[:] = [m for m in members if m["status"] == "failed"]
            summary_path = sweep_dir / "summary.md"
            from flows import sweep_parent

            sweep_parent.publish(summary, to_markdown(summary, inline=True))
            print(f"\nloraflow: sweep of {len(members)} member(s) done; summary in {sweep_dir / 'summary.md'}")
        except Exception as e:  # the members' results are on disk; a broken summary must not hide them
            log.warning("sweep summary: not written (%s: %s)", type(e).__name__, e)
