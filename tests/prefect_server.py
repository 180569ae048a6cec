"""A real `prefect server start` (and workers) in subprocesses, for end-to-end tests.

    with prefect_server(tmp_path, auth_string="s3cret") as server:
        server.cli("work-pool", "create", "pool", "--type", "process")
        worker = server.start_worker("pool")
        ...
    # every process started here is gone, whatever happened inside the block

Each process runs in its own process group (its own session), so stopping it also stops what it started
(the server's uvicorn and services, a worker's flow-run processes that stay in its group): SIGTERM to the
group, then SIGKILL after a timeout. The server gets a temporary PREFECT_HOME and a temporary SQLite
database; clients get `server.env`, built from a clean copy of os.environ without any PREFECT_* setting
of the calling process (pytest's conftest points PREFECT_HOME at the session's test API).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))  # the venv's CLI, next to its python
# The same CLI (the `prefect` script runs `prefect.cli:app`), with Python's cyclic garbage collector paused
# while it imports, then frozen, as loraflow starts its own temporary server (flows/console.py): a server
# is ready sooner and costs the suite less CPU. What runs is unchanged.
SETTLED_PREFECT = """import gc, sys
gc.disable()
import prefect.cli
if sys.argv[1:3] == ["server", "start"]:
    import prefect.server.api.server, uvicorn
gc.freeze()
gc.enable()
sys.argv[0] = "prefect"
sys.exit(prefect.cli.app())
"""
PREFECT_CLI = [sys.executable, "-c", SETTLED_PREFECT]
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


# A Prefect database at the schema's head, copied into each new server's or home's folder: migrating a new
# database is most of a server's start (9.0 s of CPU to answer on a new one, 4.2 s on a copy; `prefect server
# database upgrade`: 8.3 s; measured 11-28). Under xdist the controller makes it once for all its workers
# (conftest.pytest_configure) and names it here; otherwise each test process makes its own on first use.
MIGRATED_DB_ENV = "LORAFLOW_TESTS_MIGRATED_DB"
_MIGRATED_DB: Path | None = None
_MIGRATED_DB_MISSING = False  # the controller's did not appear: later callers fail at once, not after another wait


def make_migrated_database(path: Path) -> Path:
    """`prefect server database upgrade` on a new database, which then appears at `path` whole (renamed in)."""
    work = Path(tempfile.mkdtemp(prefix="loraflow-prefect-migrating-", dir=path.parent))
    subprocess.run([*PREFECT_CLI, "--no-prompt", "server", "database", "upgrade", "-y"], cwd=work,
                   env=clean_env(PREFECT_HOME=str(work)), check=True, capture_output=True, timeout=600)
    assert not (work / "prefect.db-wal").exists()  # SQLite folds its log back in when the last connection closes
    os.replace(work / "prefect.db", path)
    shutil.rmtree(work, ignore_errors=True)
    return path


def migrated_database(timeout: float = 600) -> Path:
    """The session's migrated database (see MIGRATED_DB_ENV): waited for where the controller is making it."""
    global _MIGRATED_DB, _MIGRATED_DB_MISSING
    if _MIGRATED_DB is None:
        shared = os.environ.get(MIGRATED_DB_ENV)
        if shared:
            deadline = time.monotonic() + timeout  # generous: it is made beside 3 busy workers
            while not Path(shared).exists():
                if _MIGRATED_DB_MISSING or time.monotonic() > deadline:
                    _MIGRATED_DB_MISSING = True
                    raise RuntimeError(f"the test session's migrated Prefect database {shared} did not appear "
                                       f"in {timeout:.0f} s (xdist's controller makes it: see its output)")
                time.sleep(0.2)
            _MIGRATED_DB = Path(shared)
        else:
            _MIGRATED_DB = make_migrated_database(
                Path(tempfile.mkdtemp(prefix="loraflow-prefect-migrated-")) / "prefect.db")
    return _MIGRATED_DB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without PREFECT_* settings (and without pytest's own variables), plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "PYTEST_")) and k not in {"COV_CORE_SOURCE", "COV_CORE_CONFIG"}}
    env.update(COLUMNS="200", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")  # wide CLI output: no wrapped UUIDs
    env.update(extra)
    return env


def _live_processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live (non-zombie) process, from /proc (Linux).
    Zombies are left out: they wait for a reaper and hold nothing."""
    table: dict[int, tuple[int, int]] = {}
    if not Path("/proc/self/stat").exists():
        return table
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if fields[0] not in "ZX":
            table[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return table


class Process:
    """A command in its own process group, output to a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, cwd: Path = REPO):
        self.name, self.cmd, self.log = name, cmd, log
        self._log_file = open(log, "wb")
        self.popen = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.popen.pid  # == its process group id
        self._known: set[int] = set()  # every descendant seen so far (pids are not reused that fast)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def members(self) -> set[int]:
        """Live processes it started: its process group, plus descendants that left the group (a
        worker's flow-run processes get a session of their own). Linux; elsewhere just the leader."""
        if not Path("/proc/self/stat").exists():
            return {self.pid} if self.alive() else set()
        table = _live_processes()
        found = {pid for pid, (_, pgrp) in table.items() if pgrp == self.pid}
        found |= self._known & set(table)
        grew = True
        while grew:  # descendants of anything found so far
            new = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
            found |= new
            grew = bool(new)
        self._known |= found
        return found

    def _group(self) -> set[int]:
        return {pid for pid, (_, pgrp) in _live_processes().items() if pgrp == self.pid}

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the group and every descendant, SIGKILL to whatever is left after `timeout`;
        reaps the leader."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            targets = self.members()
            if not self.alive() and not targets:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
            for pid in targets - self._group():  # descendants in sessions of their own
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=0.2)
                if not self.alive() and not self.members():
                    break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        self._log_file.close()

    def tail(self, chars: int = 6000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        args = self.cmd[3:6] if self.cmd[1:2] == ["-c"] else self.cmd[1:4]  # after `python -c CODE`
        return f"----- {self.name} ({' '.join(args)} ...), log {self.log} -----\n{text[-chars:]}"


class PrefectServer:
    """A running server: its API URL, the env clients must use, and helpers that use that env."""

    def __init__(self, url: str, env: dict[str, str], root: Path, auth_string: str | None):
        self.url, self.env, self.root, self.auth_string = url, env, root, auth_string
        self.processes: list[Process] = []

    # --- processes -------------------------------------------------------------------------------------
    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Process:
        proc = Process(name, [*PREFECT_CLI, *args], env or self.env, self.root / f"{name}.log")
        self.processes.append(proc)
        return proc

    def start_worker(self, pool: str, name: str = "worker", query_seconds: int = 2, **env: str) -> Process:
        """`prefect worker start --pool POOL --type process`; its flow runs inherit its env."""
        return self.start(name, "worker", "start", "--pool", pool, "--type", "process", "--name", name,
                          env={**self.env, "PREFECT_WORKER_QUERY_SECONDS": str(query_seconds), **env})

    def stop_all(self) -> None:
        for proc in reversed(self.processes):  # workers first, the server last
            start = time.monotonic()
            proc.stop()
            proc.stop_seconds = time.monotonic() - start

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.processes)

    # --- CLI and API -----------------------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = 180, check: bool = True, cwd: Path = REPO) -> str:
        """Runs `prefect --no-prompt ARGS` as a client of this server; returns stdout+stderr."""
        done = subprocess.run([*PREFECT_CLI, "--no-prompt", *args], env=self.env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        out = done.stdout + done.stderr
        if check and done.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} exited {done.returncode}:\n{out}\n{self.logs()}")
        return out

    def request(self, method: str, path: str, auth: bool = True, **kw) -> httpx.Response:
        headers = dict(kw.pop("headers", {}))
        if auth and self.auth_string is not None:
            headers["Authorization"] = "Basic " + _b64(self.auth_string)
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kw)

    def flow_run(self, flow_run_id: str) -> dict:
        r = self.request("GET", f"/flow_runs/{flow_run_id}")
        r.raise_for_status()
        return r.json()

    def flow_run_logs(self, flow_run_id: str) -> str:
        r = self.request("POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                       "sort": "TIMESTAMP_ASC", "limit": 200})
        return "\n".join(f"{x['level']:>2} {x['message']}" for x in r.json()) if r.is_success else r.text

    def run_deployment(self, name: str, *args: str) -> str:
        """`prefect deployment run NAME ARGS`; returns the new flow run's id."""
        out = self.cli("deployment", "run", name, *args)
        found = re.search(r"UUID:\s*(" + UUID.pattern + ")", out)
        assert found, f"no flow run id in:\n{out}"
        return found.group(1)

    def wait_for(self, flow_run_id: str, timeout: float = 300, watch: Process | None = None) -> dict:
        """Polls the flow run until it is terminal; on failure or timeout, fails with the run's logs and
        every process's log."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.flow_run(flow_run_id)
            state = (run.get("state") or {}).get("type")
            if state in TERMINAL:
                break
            why = None
            if time.monotonic() > deadline:
                why = f"timed out after {timeout:.0f}s"
            elif watch is not None and not watch.alive():
                why = f"{watch.name} exited with {watch.popen.returncode}"
            if why:
                raise AssertionError(f"flow run {flow_run_id} is {state}: {why}\n"
                                     f"{self.flow_run_logs(flow_run_id)}\n{self.logs()}")
            time.sleep(1)
        if state != "COMPLETED":
            raise AssertionError(f"flow run {flow_run_id} ended {state}: {run['state'].get('message')}\n"
                                 f"{self.flow_run_logs(flow_run_id)}\n{self.logs()}")
        return run


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


def wait_until_healthy(url: str, timeout: float, proc: "Process | None" = None) -> None:
    """Until GET {url}/health answers 200; RuntimeError after `timeout` s, or at once if `proc` (the server,
    when the caller started it) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if proc is not None and not proc.alive():
            raise RuntimeError(f"prefect server exited with {proc.popen.returncode}\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"prefect server at {url} not healthy after {timeout}s"
                               + (f"\n{proc.tail()}" if proc is not None else ""))
        time.sleep(0.5)


@contextlib.contextmanager
def prefect_server(root: Path, auth_string: str | None = None, startup_timeout: float = 120,
                   services: dict[str, bool] | None = None,
                   server_settings: dict[str, str] | None = None, port: int | None = None) -> Iterator[PrefectServer]:
    """Starts `prefect server start --host 127.0.0.1 --port <free>` with PREFECT_HOME and a SQLite database
    under `root` (a copy of the migrated one unless `root` has one); yields a PrefectServer once GET
    /api/health answers. On exit (also on error) stops every process started through it (workers included),
    group by group.

    `services` switches server services on or off, e.g. {"scheduler": False}; `server_settings` adds settings
    for the server only (e.g. PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS); `port`: a free port chosen
    beforehand (the caller hands its URL out before the server answers).
    """
    root = Path(root)
    home = root / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    if not (root / "prefect.db").exists():  # a new server's database, already migrated (MIGRATED_DB_ENV)
        shutil.copyfile(migrated_database(), root / "prefect.db")
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/api"
    client_env = clean_env(PREFECT_HOME=str(home), PREFECT_API_URL=url, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    if auth_string is not None:
        client_env["PREFECT_API_AUTH_STRING"] = auth_string
    server_env = clean_env(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                           PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{root / 'prefect.db'}",
                           PREFECT_SERVER_UI_ENABLED="false")
    if auth_string is not None:
        server_env["PREFECT_SERVER_API_AUTH_STRING"] = auth_string
    for service, enabled in (services or {}).items():
        server_env[f"PREFECT_SERVER_SERVICES_{service.upper()}_ENABLED"] = str(enabled).lower()
    server_env.update(server_settings or {})

    server = PrefectServer(url, client_env, root, auth_string)
    try:
        proc = server.start("server", "server", "start", "--host", "127.0.0.1", "--port", str(port),
                            env=server_env)
        wait_until_healthy(url, startup_timeout, proc)
        yield server
    finally:
        server.stop_all()
