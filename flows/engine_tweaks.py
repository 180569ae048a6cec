"""Two changes to how Prefect 3.8's engine runs loraflow's flow, each for the CLI's start-up (bench/RESULTS.md,
figure 6) and each a no-op where this Prefect lacks what it relies on.

- The heartbeat thread is not joined. The sync engine beats a flow run's heartbeat
  (`PREFECT_FLOWS_HEARTBEAT_FREQUENCY`, 180 s by default; what a zombie-run automation watches) from a daemon
  thread that sleeps in `time.sleep(1)` steps, and joins it when the flow ends: every flow run lasted until the
  thread's next whole second (0.7 s of a 2.35 s no-op). Prefect's own async engine does not join it
  (`join_on_exit=False`); the CLI has the sync engine do the same. Prefect's thread checks its stop flag
  before a beat but not atomically with it: a beat that passed the check just as the run ended could reach
  Prefect's events service after the process had stopped it, which logs an error with a traceback (seen in a
  busy suite run, 11-27, on a run that failed in its first 80 ms). So each beat takes a lock and beats only
  while the run is on; the run's end takes the same lock, waiting for a beat in flight (a queue put, not the
  thread's sleep) and ending all later ones. Heartbeats while the flow runs are unchanged.
- The flow's parameters (a config name and a list of override strings: JSON as they are) are sent as they are.
  Prefect passes every parameter through FastAPI's `jsonable_encoder`, and importing FastAPI for that was 60 ms
  of every run's start-up. Any other value still goes through Prefect's encoder."""
from __future__ import annotations

import contextlib
import inspect
import threading


def stop_joining_heartbeats() -> bool:
    """Have Prefect's sync flow engine not join its heartbeat thread; False (nothing changed) where this Prefect
    has no such switch."""
    from prefect import flow_engine

    send = getattr(flow_engine, "_send_heartbeats", None)
    if getattr(send, "loraflow_unjoined", False):  # done already
        return True
    if send is None or "join_on_exit" not in inspect.signature(send).parameters:
        return False

    @contextlib.contextmanager
    def unjoined(engine, join_on_exit: bool = True):
        beats = _guarded_beats(engine)
        with beats["lock"]:
            beats["on"] = True
        try:
            with send(engine, join_on_exit=False):
                yield
        finally:
            with beats["lock"]:  # a beat in flight ends first; none starts after
                beats["on"] = False

    unjoined.loraflow_unjoined = True
    flow_engine._send_heartbeats = unjoined
    return True


def _guarded_beats(engine) -> dict:
    """The engine's beats, each under a lock and only while a run context is on. Once per engine: a flow's
    retries enter the run context again on the same engine (a thread of an earlier try may then beat for the
    live run, which is harmless)."""
    beats = engine.__dict__.get("_loraflow_beats")
    if beats is None:
        beats = engine._loraflow_beats = {"lock": threading.Lock(), "on": False}
        beat = engine._emit_flow_run_heartbeat  # the thread looks it up on the engine at every beat

        def guarded(*args, **kwargs):
            with beats["lock"]:
                if beats["on"]:
                    beat(*args, **kwargs)

        engine._emit_flow_run_heartbeat = guarded
    return beats


def _plain(value) -> bool:
    return value is None or isinstance(value, (str, bool, int, float)) or \
        isinstance(value, list) and all(isinstance(v, str) for v in value)


def send_plain_parameters(flow) -> None:
    """`flow` sends parameters that are JSON as they are (strings, numbers, lists of strings) without Prefect's
    encoder; any other value goes through it as before."""
    encode = flow.serialize_parameters

    def serialize_parameters(parameters: dict) -> dict:
        if all(_plain(v) for v in parameters.values()):
            return {k: list(v) if isinstance(v, list) else v for k, v in parameters.items()}
        return encode(parameters)

    flow.serialize_parameters = serialize_parameters
