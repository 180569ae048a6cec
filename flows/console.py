"""What a person at a terminal meets: Ctrl-C / SIGTERM, exit codes, user errors printed once.

    exit 2    a user error (data, config, missing model/prompts/store package, store full): one message
    exit 3    no Prefect API: the temporary server did not start, PREFECT_API_URL does not answer, or the API
              went away mid-run (flows/prefect_api.py): one message; the store keeps every finished item
    exit 130  stopped by SIGINT (Ctrl-C); 143 by SIGTERM. Finished items and a checkpoint of the last
              finished training step are kept; the same command continues.
Prefect's temporary API server is started in its own session, so the terminal's Ctrl-C (sent to the
whole process group) does not stop it under the running flow; loraflow stops it on the way out. A loraflow
killed outright (SIGKILL, OOM killer) cannot: a guard process beside it stops the server then."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys

from flows import prefect_api
from tasks.training import interrupt

EXIT_USER_ERROR = 2
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _on_signal(signum, frame) -> None:
    # (inside training, tasks/interrupt.until_safe_point catches this, lets the step end, then raises it again)
    interrupt.request_stop(signum)
    raise interrupt.Interrupted(signum)


def install_signal_handlers() -> None:
    for signum in EXIT_CODES:
        signal.signal(signum, _on_signal)


def shield_temporary_server() -> None:
    """Start Prefect's temporary API server (uvicorn subprocess) in a session of its own. With PREFECT_API_URL set
    none is started: nothing to do (and Prefect's server code, 2 s of imports, is not loaded)."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        return
    from prefect.server.api import server

    cls = server.SubprocessASGIServer
    if getattr(cls, "_loraflow_shielded", False):
        return
    run = cls._run_uvicorn_command

    @functools.wraps(run)
    def in_own_session(self):
        popen = subprocess.Popen

        def settled_in_own_session(args, *rest, **kwargs):
            return popen(settled_uvicorn(args), *rest, start_new_session=True, **kwargs)

        subprocess.Popen = settled_in_own_session
        try:
            server = run(self)
        finally:
            subprocess.Popen = popen
        _guard(server.pid)
        return server

    cls._run_uvicorn_command, cls._loraflow_shielded = in_own_session, True
    prefect_api.guard_start(cls)  # one start at a time per PREFECT_HOME, a load-scaled timeout, one retry


# `python -m uvicorn ARGS` as Prefect starts its temporary server, but with the cyclic garbage collector paused
# while uvicorn and Prefect's server import, then frozen (as tasks/lazy.py settles torch): ready to answer in
# 5.6 s instead of 7.1 s on 2 cores (6.7 -> 5.3 s of CPU; measured 11-27). Then it runs as uvicorn's own main.
_SETTLED_UVICORN = """import gc, sys
gc.disable()
import prefect.server.api.server, uvicorn.main
gc.freeze()
gc.enable()
sys.argv[0] = "uvicorn"
sys.exit(uvicorn.main.main())
"""


def settled_uvicorn(args):
    """Prefect's uvicorn command, settled; any other command unchanged."""
    if isinstance(args, (list, tuple)) and len(args) > 2 and list(args[1:3]) == ["-m", "uvicorn"]:
        return [args[0], "-c", _SETTLED_UVICORN, *args[3:]]
    return args


# Stops the server's session once loraflow (its parent) is gone, however it went (after a normal exit the
# server is already stopped). In a session of its own, like the server: a signal to loraflow's process group
# does not end it first.
_GUARD = """
import os, signal, sys, time
parent, server = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.5)
try:
    os.killpg(server, signal.SIGTERM)
except OSError:
    pass
"""


_guards: list[subprocess.Popen] = []  # held: never waited on, it ends after loraflow


def _guard(server_pid: int) -> None:
    with contextlib.suppress(OSError):  # -S: no site-packages, it starts in milliseconds
        _guards.append(subprocess.Popen([sys.executable, "-S", "-c", _GUARD, str(os.getpid()), str(server_pid)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True))


def stop_temporary_server() -> None:
    from prefect.logging.handlers import APILogWorker

    with contextlib.suppress(Exception):
        APILogWorker.drain_all(timeout=5)  # the run's last log lines reach the API before it stops
    if "prefect.server.api.server" not in sys.modules:  # no temporary server was started in this process
        return
    from prefect.server.api import server

    for instance in list(server.SubprocessASGIServer._instances.values()):
        with contextlib.suppress(Exception):
            instance.stop()


class _QuietUserErrors(logging.Filter):
    """Drops Prefect's engine records of a user error or an interruption (their tracebacks, and the
    'Finished in state Failed(<message>)' lines that repeat the message): the CLI prints it once."""

    def __init__(self, quiet: tuple):
        super().__init__()
        self.quiet, self.seen = quiet, []

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("prefect", "EventsWorker")):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.quiet):
            self.seen.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return False
        if exc is not None and prefect_api.lost_mid_run(exc) or _api_unreachable_noise(record):
            return False  # the API went away: the CLI says so in one line (flows/prefect_api.py)
        text = record.getMessage()
        if any(m in text for m in _STOPPED_LINES):  # the runs' "Finished in state Crashed(...)" on a Ctrl-C or
            return False  # SIGTERM (Prefect's own handler's words for SIGTERM), no exception attached: the CLI's line says it
        return not any(s and s in text for s in self.seen)


_STOPPED_LINES = ("Interrupted: interrupted by SIG", "Execution was aborted by a termination signal")


def _api_unreachable_noise(record: logging.LogRecord) -> bool:
    """Prefect's background services' lines while the API does not answer (the events websocket, each event it
    could not send, the batches left): the CLI's one line says it instead."""
    text = record.getMessage()
    return any(n in text for n in ("Unable to connect to 'ws://", "Unable to connect to 'wss://",
                                   "Service 'EventsWorker' failed to process item", "Still processing items"))


def quiet_user_errors(quiet: tuple) -> None:
    """Installs the filter on every handler of the root and prefect loggers, and on Prefect's run loggers."""
    filt = _QuietUserErrors(quiet + (interrupt.Interrupted,))
    # Prefect's log shipper writes "--- Error logging to API ---" straight to stderr for every batch it could not
    # send while the API is away, under logging.raiseExceptions (the stdlib's switch for handler errors)
    logging.raiseExceptions = False
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs", "prefect.flow_engine", "prefect.task_engine",
                 "prefect._internal.concurrency", "prefect.events.clients", "EventsWorker"):
        logger = logging.getLogger(name)
        logger.addFilter(filt)
        for handler in logger.handlers:
            handler.addFilter(filt)


def exit_interrupted(e: interrupt.Interrupted) -> None:
    kept = " and ".join(["every finished item in the store", *interrupt.kept_items()])
    print(f"\nloraflow: interrupted ({signal.Signals(e.signum).name}); kept {kept}. "
          f"Run the same command again to continue.", file=sys.stderr, flush=True)
    stop_temporary_server()
    sys.exit(EXIT_CODES.get(e.signum, 128 + e.signum))


def exit_user_error(e: BaseException, stopped: str = "stopped before training") -> None:
    print(f"\nloraflow: {stopped}: {e}", file=sys.stderr, flush=True)
    stop_temporary_server()
    sys.exit(EXIT_USER_ERROR)


def exit_no_api(message: str) -> None:
    print(f"\nloraflow: stopped: {message}", file=sys.stderr, flush=True)
    stop_temporary_server()
    sys.exit(prefect_api.EXIT_NO_API)
