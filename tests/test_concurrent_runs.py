"""Issue 46: many runs on one machine. As many CLI runs as the machine has cores + 2 (at least 4) start together,
each with its own store and run folder, all sharing one fresh PREFECT_HOME (a new user's ~/.prefect, its database
not migrated yet) and no server running: every one exits 0 with the LoRA the same run makes alone. A Prefect API
that cannot be had gets one line and exit 3 (flows/prefect_api.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.prefect_api import ENV_TIMEOUT, EXIT_NO_API, startup_timeout
from support import run_cli

REPO = Path(__file__).resolve().parents[1]
ARGS = [f"data.dir={REPO / 'data' / 'demo'}", "data.resolution=32", "train.max_steps=2", "train.batch_size=2",
        "sample.steps=2", "train.log_with=none"]
N = max(4, (os.cpu_count() or 1) + 2)


def _env(home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", ENV_TIMEOUT)}
    return {**env, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(home), **extra}


def _lora(run_dir: Path) -> bytes:
    return (run_dir / "lora" / "pytorch_lora_weights.safetensors").read_bytes()


@pytest.mark.timeout(1800)  # N runs on the cores the suite's other workers also use: minutes, not seconds
def test_runs_started_together_on_a_fresh_prefect_home_all_finish(tmp_path):
    home = tmp_path / "prefect-home"  # created by the first run: no database yet, no server
    procs = [subprocess.Popen([sys.executable, "-m", "flows.train", *ARGS, f"store.root={tmp_path / f's{i}'}",
                               f"hydra.run.dir={tmp_path / f'r{i}'}"], cwd=tmp_path, env=_env(home), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(N)]
    outs = [p.communicate(timeout=1700) for p in procs]
    failed = [f"run {i}: exit {p.returncode}: {err[-1500:]}" for i, (p, (_, err)) in enumerate(zip(procs, outs))
              if p.returncode != 0]
    assert not failed, "\n".join(failed)
    # the reference run alone, on the test session's API server (which API a run reports to changes no byte)
    alone = run_cli([*ARGS, f"store.root={tmp_path / 'alone'}", f"hydra.run.dir={tmp_path / 'ra'}"], tmp_path, tmp_path)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert all(_lora(tmp_path / f"r{i}") == _lora(tmp_path / "ra") for i in range(N))


def test_a_temporary_server_that_cannot_start_is_one_line_and_exit_3(tmp_path):
    out = subprocess.run([sys.executable, "-m", "flows.train", *ARGS, f"store.root={tmp_path / 's'}",
                          f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path, text=True, capture_output=True,
                         env=_env(tmp_path / "home", **{ENV_TIMEOUT: "1"}), timeout=600)  # 1 s: too short to start
    assert out.returncode == EXIT_NO_API, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "temporary API server did not start" in out.stderr
    assert f"{ENV_TIMEOUT}=300" in out.stderr  # the fix
    assert not list((tmp_path / "s").rglob("*.tmp*"))  # nothing half-written


def test_a_configured_api_that_does_not_answer_is_one_line_and_exit_3(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "flows.train", *ARGS, f"store.root={tmp_path / 's'}"], cwd=tmp_path,
                         text=True, capture_output=True, timeout=600,
                         env={**_env(tmp_path / "home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"})
    assert out.returncode == EXIT_NO_API and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"PREFECT_API_URL=http://127.0.0.1:{port}/api does not answer" in out.stderr
    assert not (tmp_path / "s").exists()  # stopped before any work


def test_the_start_up_allowance_follows_the_load(monkeypatch):
    monkeypatch.delenv(ENV_TIMEOUT, raising=False)
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert startup_timeout() == 20.0  # an idle machine: Prefect's own allowance
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cores, 0.0, 0.0))
    assert startup_timeout() == 60.0  # three runnable processes a core: three times as long
    monkeypatch.setenv(ENV_TIMEOUT, "45")
    assert startup_timeout() == 45.0  # the user's setting wins



@pytest.mark.timeout(1200)
def test_an_api_that_goes_away_mid_run_is_one_line_and_the_same_command_continues(tmp_path):
    from prefect_server import prefect_server

    args = [*ARGS, "train.max_steps=300", "train.log_every=1", f"store.root={tmp_path / 's'}"]
    with prefect_server(tmp_path / "server") as server:
        # Prefect's client retries a refused connection for minutes by default: once is enough to see it go
        env = {**server.env, "PREFECT_CLIENT_MAX_RETRIES": "1"}
        run = subprocess.Popen([sys.executable, "-m", "flows.train", *args, f"hydra.run.dir={tmp_path / 'r1'}"],
                               cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lines = []
        for line in run.stdout:  # the server goes once training has started
            lines.append(line)
            if "train: step" in line:
                break
        server.stop_all()
        rest, _ = run.communicate(timeout=900)
    output = "".join(lines) + rest
    assert run.returncode == EXIT_NO_API, output[-3000:]
    assert "stopped answering during the run" in output and "Traceback" not in output, output[-3000:]
    assert "Error logging to API" not in output and "EventsWorker" not in output  # Prefect's services: quiet
    again = run_cli([*args, f"hydra.run.dir={tmp_path / 'r2'}"], tmp_path, tmp_path, own_api=True)  # a temporary one now
    assert again.returncode == 0, again.stderr[-2000:]
    whole = run_cli([*ARGS, "train.max_steps=300", "train.log_every=1", f"store.root={tmp_path / 'w'}",
                     f"hydra.run.dir={tmp_path / 'rw'}"], tmp_path, tmp_path)  # uninterrupted: the session's API
    assert whole.returncode == 0 and _lora(tmp_path / "r2") == _lora(tmp_path / "rw")


def test_the_temporary_server_starts_settled_and_answers(tmp_path):
    """flows/console.py: Prefect's `python -m uvicorn ...` becomes the same uvicorn main with the collector paused
    over its imports; the server it starts answers and stops (the CLI runs above use it end to end)."""
    import httpx

    from flows.console import _SETTLED_UVICORN, settled_uvicorn
    from prefect_server import free_port

    assert settled_uvicorn(["py", "-m", "other", "x"]) == ["py", "-m", "other", "x"]
    assert settled_uvicorn("py -m uvicorn") == "py -m uvicorn"  # a shell string: left as it is
    args = settled_uvicorn([sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
                            "--host", "127.0.0.1", "--port", str(port := free_port()), "--log-level", "error"])
    assert args[:3] == [sys.executable, "-c", _SETTLED_UVICORN] and args[3:5] == ["--factory", "prefect.server.api.server:create_app"]
    env = {**_env(tmp_path / "home"), "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT_UI_ENABLED": "0"}
    server = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert server.poll() is None, server.stdout.read()[-3000:]
            time.sleep(0.2)
        else:
            raise AssertionError("the settled server did not answer in 120 s")
    finally:
        server.terminate()
        # uvicorn's graceful shutdown, then the signal raised again: what `python -m uvicorn` does (checked 11-27)
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
