"""The Prefect API a CLI run talks to: its temporary server started safely beside other runs, a configured one
checked before any work, and one line (exit 3) when neither can be had.

Several runs on one machine (a sweep's members, a few datasets overnight, a shared GPU server) each start a
temporary API server when PREFECT_API_URL is not set. Two things failed there (issue 46): runs sharing a new
PREFECT_HOME migrated its SQLite database at once (alembic: "expected to match one row"), and Prefect's 20 s
start-up allowance ran out on a busy machine. So a run starts its server holding a lock in PREFECT_HOME: the runs
sharing a home start one at a time (the first migrates, the others find the database migrated), and each start is
allowed a time scaled to the machine's load, once more at twice that if it fails. A run against a configured
PREFECT_API_URL starts nothing and is unchanged, but for a check that the URL answers (one line if not).

Why not one local server shared by the concurrent runs: it would need an owner that outlives the first run and a
way to clean up after a kill -9 of that owner, and a sweep of many runs already has a documented path for it
(`prefect server start` + PREFECT_API_URL, docs/prefect.md). A lock and a timeout keep every run independent."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

EXIT_NO_API = 3
LOCK_NAME = "loraflow-temporary-server.lock"
BASE_TIMEOUT_S, MAX_TIMEOUT_S = 20.0, 600.0  # Prefect's default allowance; the most a busy machine is given
ENV_TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


class PrefectUnavailable(RuntimeError):
    """No Prefect API to run against: the message is one line with the cause and the fix."""


def startup_timeout() -> float:
    """The seconds a temporary server is allowed to start: the user's PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
    when set, else Prefect's 20 s times the machine's load per core (at least 1), at most 600 s."""
    if os.environ.get(ENV_TIMEOUT):
        return float(os.environ[ENV_TIMEOUT])
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average (Windows)
        load = 1.0
    return min(MAX_TIMEOUT_S, BASE_TIMEOUT_S * max(1.0, load))


@contextlib.contextmanager
def _home_lock():
    """An exclusive lock on PREFECT_HOME (blocking): the runs that share it start their servers one at a time."""
    from prefect.settings import get_current_settings

    home = Path(get_current_settings().home).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (each start still gets the scaled timeout and a retry)
        yield
        return
    with open(home / LOCK_NAME, "a") as f:  # released by the OS if this process dies: nothing left behind
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def guard_start(cls) -> None:
    """Wraps SubprocessASGIServer.start: the lock, the scaled timeout, one retry, then PrefectUnavailable."""
    start = cls.start
    if getattr(start, "_loraflow_guarded", False):
        return

    def start_guarded(self, timeout=None):
        if self.running:
            return None
        last = None
        with _home_lock():
            for attempt in (1, 2):
                allowed = timeout or startup_timeout() * attempt
                try:
                    return start(self, allowed)
                except RuntimeError as e:  # Prefect's "Timed out while attempting to connect ..."
                    last = e
                    _kill(self)
        raise PrefectUnavailable(
            f"Prefect's temporary API server did not start (twice, allowed {startup_timeout():.0f} s then "
            f"{2 * startup_timeout():.0f} s): {_first_line(last)}. Fix: on a busy machine set {ENV_TIMEOUT}=300, or "
            "start one server for every run (`prefect server start`) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api (docs/prefect.md)") from last

    start_guarded._loraflow_guarded = True
    cls.start = start_guarded


def _kill(server) -> None:
    """The failed start's server process, stopped (the instance stays registered for the retry)."""
    process = getattr(server, "server_process", None)
    if process is not None:
        with contextlib.suppress(Exception):
            process.kill()
            process.wait(timeout=10)
        server.server_process = None
    server.running = False


def _first_line(error: BaseException | None) -> str:
    text = str(error or "").strip()
    return (text.splitlines()[0].rstrip(".") if text else type(error).__name__)[:300]


def check_configured(url: str, wait_s: float = 10.0) -> None:
    """PrefectUnavailable unless the configured API answers its health check (retried for `wait_s` seconds)."""
    import httpx

    deadline, last = time.monotonic() + wait_s, None
    while True:
        try:
            # verify: plain http needs no certificate store (loading one costs ~20 ms at start-up)
            response = httpx.get(url.rstrip("/") + "/health", timeout=5, verify=not url.startswith("http://"))
            if response.status_code in (200, 401):  # 401: it answers; the auth check names that problem
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {_first_line(e) or 'no answer'}"
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    raise PrefectUnavailable(
        f"the Prefect API at PREFECT_API_URL={url} does not answer ({last}). Fix: start it (`prefect server "
        "start`), correct PREFECT_API_URL, or unset it to let the run start a temporary server")


def lost_mid_run(error: BaseException) -> str | None:
    """One line if `error` is the Prefect API going away during a run (a transport error in its chain)."""
    import httpx

    seen, e = 0, error
    while e is not None and seen < 10:
        if isinstance(e, (httpx.TransportError, ConnectionError)):
            from prefect.settings import get_current_settings

            url = get_current_settings().api.url or "the temporary server"
            return (f"the Prefect API ({url}) stopped answering during the run ({type(e).__name__}). Every "
                    "finished item is in the store: start the API again (or unset PREFECT_API_URL) and run the "
                    "same command to continue")
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None
