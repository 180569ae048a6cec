"""What the CLI's start-up and exit skip (issue 46, item 5; bench/RESULTS.md figure 6), and that each skip keeps
what it stands in for: the flow composes the config the pre-flight check composed, Hydra reads the mode that
check found, the process exits with the CLI's status after every exit handler ran, the flow's parameters reach
the API unchanged, and the heartbeat thread is told to stop without being waited for, and beats no more after the run ends."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from omegaconf import OmegaConf

from tasks.config import compose, held_hydra_mode

REPO = Path(__file__).resolve().parents[1]


# --- the pre-flight compose, taken by the flow -------------------------------------------------------------

def test_the_flow_takes_the_config_the_check_composed_once(tmp_path):
    overrides = ["train.lr=0.0005", "hydra.job.name=check"]
    held, _ = compose("train", overrides, hold=True)
    flow_overrides = ["train.lr=0.0005", f"hydra.run.dir={tmp_path / 'run'}"]  # what the CLI's flow run gets
    taken, run_dir = compose("train", flow_overrides)
    assert run_dir == tmp_path / "run"
    assert taken is not held and OmegaConf.to_container(taken) == OmegaConf.to_container(held)
    again, _ = compose("train", flow_overrides)  # taken once: the next compose is Hydra's
    assert again is not taken and OmegaConf.to_container(again) == OmegaConf.to_container(taken)
    assert held_hydra_mode("train", overrides) == (True, None)  # no config or override sets hydra.mode
    assert held_hydra_mode("train", overrides) == (False, None)


def test_another_job_or_an_interpolated_run_dir_composes_anew(tmp_path):
    compose("train", ["train.lr=0.0005"], hold=True)
    other, _ = compose("train", ["train.lr=0.0007", f"hydra.run.dir={tmp_path}"])
    assert other.train.lr == 0.0007
    # the same job with a run folder Hydra must resolve: composed, and the held config is dropped
    _, run_dir = compose("train", ["train.lr=0.0005", "hydra.run.dir=" + str(tmp_path) + "/${hydra.job.name}"])
    assert run_dir == tmp_path / "train"
    fresh, _ = compose("train", ["train.lr=0.0005", f"hydra.run.dir={tmp_path}"])
    assert fresh.train.lr == 0.0005
    assert held_hydra_mode("train", ["train.lr=0.0005"]) == (True, None)


def test_hydra_is_given_the_mode_the_check_found(monkeypatch):
    from hydra._internal.hydra import Hydra
    from hydra.types import RunMode

    import flows.cli as cli

    asked = []
    monkeypatch.setattr(Hydra, "get_mode", lambda self, config_name, overrides: asked.append(overrides) or "composed")
    cli.check_config_only("train", ["hydra.mode=MULTIRUN"], hold=True)
    cli._tell_hydra_the_mode()
    assert Hydra.get_mode(None, "train", ["hydra.mode=MULTIRUN"]) == RunMode.MULTIRUN and asked == []
    assert Hydra.get_mode(None, "train", ["hydra.mode=MULTIRUN"]) == "composed"  # once; then Hydra composes
    assert Hydra.get_mode(None, "train", ["train.lr=0.1"]) == "composed" and len(asked) == 2
    compose("train", ["hydra.mode=MULTIRUN", "hydra.run.dir=x"])  # takes the held config: nothing left behind


# --- the exit --------------------------------------------------------------------------------------------

_CLI = """
import atexit, sys, threading, time
from flows.entry import run_and_exit

class Loud:  # said when the interpreter tears its modules down, which the CLI's exit skips
    def __del__(self):
        sys.stderr.write("torn down\\n")

kept = Loud()

def slow_writer(path):
    time.sleep(0.3)
    open(path, "w").write("thread")

def cli():
    threading.Thread(target=slow_writer, args=(sys.argv[1] + ".thread",)).start()  # not a daemon
    atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("handler"))
    print("said without a newline", end="")
    {ending}

run_and_exit(cli)
raise SystemExit("run_and_exit returned")
"""


def _exit_of(tmp_path: Path, ending: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CLI.format(ending=ending), str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_the_cli_exits_with_its_status_after_threads_and_exit_handlers(tmp_path):
    for ending, status in (("sys.exit(7)", 7), ("return None", 0), ("sys.exit(None)", 0), ("sys.exit(-1)", 255)):
        out = _exit_of(tmp_path, ending)
        assert out.returncode == status, (ending, out.stderr[-2000:])
        assert out.stdout == "said without a newline", ending  # buffered output flushed
        assert (tmp_path / "out.thread").read_text() == "thread"  # a non-daemon thread finished first
        assert (tmp_path / "out.atexit").read_text() == "handler"  # the exit handlers ran
        assert "torn down" not in out.stderr, ending  # the interpreter's teardown was skipped
        for f in tmp_path.iterdir():
            f.unlink()


def test_a_profiled_cli_leaves_as_python_does_so_the_profile_is_written(tmp_path):
    script = tmp_path / "cli.py"
    script.write_text(_CLI.format(ending="sys.exit(3)"))
    out = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "p.prof"), str(script),
                          str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    # cProfile's own runner swallows the program's SystemExit: status 0 from `python -m cProfile`
    assert out.returncode == 0 and (tmp_path / "p.prof").stat().st_size > 0, out.stderr[-2000:]
    assert (tmp_path / "out.atexit").read_text() == "handler"


def test_an_error_or_a_message_leaves_as_python_does(tmp_path):
    out = _exit_of(tmp_path, "raise ValueError('bad')")
    assert out.returncode == 1 and "ValueError: bad" in out.stderr and "Traceback" in out.stderr
    assert (tmp_path / "out.atexit").read_text() == "handler"
    out = _exit_of(tmp_path, "sys.exit('loraflow: stopped: why')")
    assert out.returncode == 1 and out.stderr.startswith("loraflow: stopped: why")


# --- Prefect's engine --------------------------------------------------------------------------------------

def test_a_flow_run_with_the_tweaks_keeps_its_parameters_and_completes(prefect_api, monkeypatch, tmp_path):
    from prefect import flow, flow_engine
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from flows import engine_tweaks

    monkeypatch.setattr(flow_engine, "_send_heartbeats", flow_engine._send_heartbeats)  # restored after
    original = flow_engine._send_heartbeats
    assert engine_tweaks.stop_joining_heartbeats()
    tweaked = flow_engine._send_heartbeats
    assert tweaked is not original and engine_tweaks.stop_joining_heartbeats()
    assert flow_engine._send_heartbeats is tweaked  # applied once, not nested

    @flow(name="loraflow-tweaks-check", persist_result=False)
    def check(config_name: str = "train", overrides: list[str] | None = None, where: Path | None = None) -> str:
        return str(flow_run.id)

    encode = check.serialize_parameters
    engine_tweaks.send_plain_parameters(check)
    plain = {"config_name": "train", "overrides": ["train.lr=0.1", "hydra.run.dir=/x"], "where": None}
    assert check.serialize_parameters(plain) == encode(plain) == plain
    assert check.serialize_parameters({**plain, "where": tmp_path}) == encode({**plain, "where": tmp_path})

    run_id = check(config_name="train", overrides=["train.lr=0.1"])
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    assert run.state.is_completed()
    assert run.parameters == {"config_name": "train", "overrides": ["train.lr=0.1"], "where": None}


class _Engine:
    """What Prefect's `_send_heartbeats` uses of a flow run engine; its beat can be held in flight."""
    heartbeat_seconds = 30  # Prefect's minimum: the thread beats once at its start, then sleeps
    flow_run = None

    def __init__(self):
        import logging

        self.logger, self.events = logging.getLogger("loraflow.test"), []
        self.in_flight, self.release = threading.Event(), threading.Event()

    def _build_heartbeat_event_template(self):
        return {}, []

    def _emit_flow_run_heartbeat(self, resource, related):
        self.events.append("beat")
        self.in_flight.set()
        assert self.release.wait(30)
        self.events.append("beat sent")


def test_no_heartbeat_reaches_prefect_after_the_run_ends(monkeypatch):
    """The race seen in a busy suite run (11-27): a beat that passed the thread's stop check as the run ended
    reached Prefect's events service after it was stopped (an error and a traceback in the CLI's output)."""
    from prefect import flow_engine

    from flows import engine_tweaks

    monkeypatch.setattr(flow_engine, "_send_heartbeats", flow_engine._send_heartbeats)  # restored after
    assert engine_tweaks.stop_joining_heartbeats()
    engine = _Engine()
    with flow_engine._send_heartbeats(engine):
        assert engine.in_flight.wait(30)  # the thread's first beat, held in flight as the run ends
        threading.Timer(0.2, engine.release.set).start()
    engine.events.append("run ended")
    assert engine.events == ["beat", "beat sent", "run ended"]  # the end waited for the beat in flight
    engine._emit_flow_run_heartbeat({}, [])  # a beat after the end (the thread past its stop check) is dropped
    assert engine.events == ["beat", "beat sent", "run ended"]

    engine.in_flight.clear()  # a retry enters the run context again on the same engine: it beats again
    with flow_engine._send_heartbeats(engine):
        assert engine.in_flight.wait(30)
    assert engine.events[3:] == ["beat", "beat sent"]


def test_the_training_flow_sends_its_parameters_as_they_are():
    from flows.train import train_flow

    params = {"config_name": "train", "overrides": ["data.dir=/d", "hydra.run.dir=/r"]}
    sent = train_flow.serialize_parameters(params)
    assert sent == params and sent["overrides"] is not params["overrides"]
