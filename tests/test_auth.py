"""A server that wants an auth string, and clients without it (or with a wrong one): the CLI, a parallel
(joblib) sweep and the worker command each say so in one line naming PREFECT_API_AUTH_STRING, exit 2,
and print no traceback."""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO
from prefect_server import prefect_server


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, text=True, capture_output=True, timeout=240)


def _says_auth_once(proc: subprocess.CompletedProcess, url: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    lines = [line for line in output.splitlines() if "PREFECT_API_AUTH_STRING" in line]
    assert len(lines) == 1 and url in lines[0] and "401" in lines[0], output[-3000:]
    for noise in ("Traceback", "BrokenProcessPool", "HTTPStatusError"):
        assert noise not in output, output[-3000:]


def test_a_missing_or_wrong_auth_string_is_one_line(tmp_path):
    with prefect_server(tmp_path / "prefect", auth_string="loraflow:secret", services={"scheduler": False}) as server:
        no_auth = {k: v for k, v in server.env.items() if k != "PREFECT_API_AUTH_STRING"}
        wrong = {**server.env, "PREFECT_API_AUTH_STRING": "loraflow:wrong"}
        run = ["-m", "flows.train", f"store.root={tmp_path / 'store'}", f"hydra.run.dir={tmp_path / 'run'}"]
        _says_auth_once(_run(run, wrong), server.url)
        sweep = ["-m", "flows.train", "-m", "train.lr=1e-3,2e-3", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                 f"store.root={tmp_path / 'store'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
        _says_auth_once(_run(sweep, no_auth), server.url)
        _says_auth_once(_run(["-m", "flows.worker", "--pool", "loraflow-pool", "--type", "process"], no_auth),
                        server.url)
    assert not (tmp_path / "store").exists()  # stopped before any work
