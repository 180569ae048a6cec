"""The stop flag: a signal (Ctrl-C, SIGTERM, a cancellation) asks the run to stop; code that can stop
cleanly only between units of work (the training loop, between optimizer steps) checks the flag there.

    request_stop(signum)   ask to stop (the signal handler in flows/console.py; a cancellation may too)
    stop_requested()       the signal number asked for, or 0
    deferred()             a context: inside it a signal only sets the flag (the loop stops at its next check)
    raise_if_requested()   raise Interrupted if asked, e.g. between nodes
    kept(text)             record what the stopped work kept, for the one line the CLI prints
"""
from __future__ import annotations

import contextlib
import signal
import threading

_state = {"signum": 0, "deferred": 0, "kept": []}


class Interrupted(BaseException):
    """The run stopped on request (a BaseException, like KeyboardInterrupt: never caught as an error)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def request_stop(signum: int = signal.SIGINT) -> None:
    _state["signum"] = _state["signum"] or int(signum)


def stop_requested() -> int:
    return _state["signum"]


def is_deferred() -> bool:
    return _state["deferred"] > 0


def _set_flag(signum, frame) -> None:
    request_stop(signum)


@contextlib.contextmanager
def deferred():
    """Inside: SIGINT/SIGTERM only set the flag (the code checks it and raises Interrupted at a safe point).
    On the way out with Interrupted, the handler that was installed before (the CLI's, or Prefect's
    SIGTERM bridge for a deployment's cancellation) gets the signal, so it decides what is raised."""
    main = threading.current_thread() is threading.main_thread()
    before = {s: signal.signal(s, _set_flag) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    _state["deferred"] += 1
    try:
        yield
    except Interrupted as e:
        _restore(before)
        if callable(handler := before.get(e.signum)):
            handler(e.signum, None)  # raises its own exception (Interrupted, TerminationSignal, KeyboardInterrupt)
        raise
    finally:
        _state["deferred"] -= 1
        _restore(before)


def _restore(handlers: dict) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def raise_if_requested() -> None:
    if _state["signum"]:
        raise Interrupted(_state["signum"])


def kept(text: str) -> None:
    _state["kept"].append(text)


def kept_items() -> list[str]:
    return list(_state["kept"])


def reset() -> None:
    _state.update(signum=0, deferred=0, kept=[])
