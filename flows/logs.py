"""loraflow's own log for every flow run: to Prefect's API (so `prefect flow-run logs <id>` and the UI show
it, CLI and deployment runs alike) and to `<run dir>/loraflow.log`.

    @flow(...)
    @run_logs            # inside the flow run: forwards the "loraflow" logger to the API while it runs
    def train_flow(...):
        ...
        log_to_file(run_dir)   # once the run dir is known

Only handlers that print nothing are added to the "loraflow" logger (the API and the file), so a terminal
shows each line once, through whatever handler the root logger has (Hydra's, or Prefect's console in a
worker's flow-run process). Records from threads without a Prefect run context (prefetch threads, tqdm)
are stamped with the flow run's id.
"""
from __future__ import annotations

from tasks.config import Config
import contextvars
import functools
import logging
from pathlib import Path

from prefect.logging.handlers import APILogHandler

LOGGER = "loraflow"
LOG_FILE = "loraflow.log"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_active: contextvars.ContextVar[list[logging.Handler] | None] = contextvars.ContextVar("loraflow_run_logs", default=None)


class ToPrefectAPI(APILogHandler):
    """Prefect's API log handler for one flow run, also for records logged outside its run context."""

    def __init__(self, flow_run_id: str):
        super().__init__()
        self.flow_run_id = flow_run_id

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "flow_run_id", None) is None:
            from prefect.context import FlowRunContext, TaskRunContext

            if FlowRunContext.get() is None and TaskRunContext.get() is None:
                record = logging.makeLogRecord({**record.__dict__, "flow_run_id": self.flow_run_id})
        super().emit(record)


class _NoUserErrorTraceback(logging.Filter):
    """Prefect's engine logs a failed task or flow with its traceback; for loraflow's user errors (bad config
    or data: the message says what to fix) the message is enough, on the terminal and in the API."""

    def filter(self, record: logging.LogRecord) -> bool:
        from flows.errors import USER_ERRORS

        if record.exc_info and isinstance(record.exc_info[1], USER_ERRORS):
            record.exc_info, record.exc_text = None, None
        return True


_QUIET = _NoUserErrorTraceback()


def quiet_user_errors() -> None:
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        if _QUIET not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_QUIET)


def _flow_run_id() -> str | None:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else None


def log_to_file(run_dir: Path) -> Path | None:
    """Adds `<run dir>/loraflow.log` (appended to) to the current run's handlers; removed when the run ends."""
    handlers = _active.get()
    if handlers is None:
        return None
    path = Path(run_dir) / LOG_FILE
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    logging.getLogger(LOGGER).addHandler(handler)
    handlers.append(handler)
    return path


def log_nodes(nodes: dict, cfg: Config | None = None, config_name: str | None = None) -> None:
    """One line per node of the report: what it did (validate checks every item each run; a cached node reused
    everything), seconds, and for a node that computed, what differs from the last run of this config name.
    A cached node's differences are no reason for work (report.json still lists them)."""
    from tasks.report import readable_changes

    name_of_config = config_name or _config_name()
    for name, e in nodes.items():
        seconds = e.get("seconds", 0.0)
        if name == "validate":
            logging.getLogger(LOGGER).info("%-14s checked %d items, %.1f s", name + ":", e.get("computed", 0), seconds)
            continue
        if name == "caption" and e.get("captions", {}).get("mode", "file") == "file":
            logging.getLogger(LOGGER).info("%-14s off (data.captions=file: the caption files are the captions)",
                                           name + ":")
            continue
        if not e.get("computed"):
            logging.getLogger(LOGGER).info("%-14s cached (%d reused), %.1f s", name + ":", e.get("reused", 0), seconds)
            continue
        why = (f"; differs from the last run of {name_of_config}: "
               f"{readable_changes(e['changed'], cfg.sample.prompts_file, cfg.data.caption_extension)}"
               if e.get("changed") and cfg else "")
        logging.getLogger(LOGGER).info("%-14s ran    %d computed, %d reused, %.1f s%s", name + ":",
                                       e["computed"], e.get("reused", 0), seconds, why)


def _config_name() -> str:
    """The flow run's config name (train_flow's parameter); "this config" outside a flow run."""
    try:
        from prefect.runtime import flow_run

        return str(flow_run.parameters.get("config_name") or "this config")
    except Exception:  # no run context: the wording only
        return "this config"


def run_logs(fn):
    """Wraps a flow function: "loraflow" records at INFO and above go to the API (and, after `log_to_file`,
    to the run's file) while it runs. An error that ends the run is written there too, never printed."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _call_with_logs(fn, args, kwargs)  # a module-level function: joblib's pickler of the sweep's callables takes it by name

    return wrapper


def _call_with_logs(fn, args, kwargs):
    """run_logs' body."""
    quiet_user_errors()
    logger = logging.getLogger(LOGGER)
    handlers: list[logging.Handler] = []
    if (flow_run_id := _flow_run_id()) is not None:
        handlers.append(ToPrefectAPI(flow_run_id))
    # Prefect's own API handler (PREFECT_LOGGING_EXTRA_LOGGERS=loraflow) steps aside while ours runs:
    # each record once, and records from threads without a run context are not dropped.
    prefects = [h for h in logger.handlers if isinstance(h, APILogHandler)] if handlers else []
    for h in prefects:
        logger.removeHandler(h)
    for h in handlers:
        logger.addHandler(h)
    level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:  # a worker's root logger is at WARNING
        logger.setLevel(logging.INFO)
    token = _active.set(handlers)
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        record = logger.makeRecord(LOGGER, logging.ERROR, __file__, 0, "stopped: %s: %s",
                                   (type(e).__name__, e), None)
        for h in handlers:  # not through the logger: the terminal gets the error once, from its caller
            h.handle(record)
        raise
    finally:
        _active.reset(token)
        logger.setLevel(level)
        for h in handlers:
            logger.removeHandler(h)
            if not isinstance(h, APILogHandler):
                h.close()
        for h in prefects:
            logger.addHandler(h)
        if handlers and isinstance(handlers[0], APILogHandler):
            handlers[0].flush()  # send this run's records before the flow run ends
