"""Two changes to how Prefect 3.8's engine runs loraflow's flow, each for the CLI's start-up (bench/RESULTS.md,
figure 6) and each a no-op where this Prefect lacks what it relies on.

- The heartbeat thread is not joined. The sync engine beats a flow run's heartbeat
  (`PREFECT_FLOWS_HEARTBEAT_FREQUENCY`, 180 s by default; what a zombie-run automation watches) from a daemon
  thread that sleeps in `time.sleep(1)` steps, and joins it when the flow ends: every flow run lasted until the
  thread's next whole second (0.7 s of a 2.35 s no-op). Prefect's own async engine does not join it
  (`join_on_exit=False`); the CLI has the sync engine do the same. The thread is still told to stop, checks
  that before every beat (nothing is emitted after the run ends) and, a daemon, never holds the exit.
  Heartbeats while the flow runs are unchanged.
- The flow's parameters (a config name and a list of override strings: JSON as they are) are sent as they are.
  Prefect passes every parameter through FastAPI's `jsonable_encoder`, and importing FastAPI for that was 60 ms
  of every run's start-up. Any other value still goes through Prefect's encoder."""
from __future__ import annotations

import functools
import inspect


def stop_joining_heartbeats() -> bool:
    """Have Prefect's sync flow engine not join its heartbeat thread; False (nothing changed) where this Prefect
    has no such switch."""
    from prefect import flow_engine

    send = getattr(flow_engine, "_send_heartbeats", None)
    if isinstance(send, functools.partial):  # done already
        return True
    if send is None or "join_on_exit" not in inspect.signature(send).parameters:
        return False
    flow_engine._send_heartbeats = functools.partial(send, join_on_exit=False)
    return True


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
