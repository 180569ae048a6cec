"""The stop flag: a signal (Ctrl-C, SIGTERM, a cancellation) asks the run to stop; code that can stop
cleanly only between units of work (the training loop, between optimizer steps) checks the flag there.

    request_stop(signum)    ask to stop (the signal handler in flows/console.py; a cancellation may too)
    stop_requested()        the signal number asked for, or 0
    until_safe_point(fn)    run fn in a thread; a signal in the main thread sets the flag, fn stops at its next
                            check, then the signal's own exception is raised again
    raise_if_requested()    raise Interrupted if asked, e.g. between nodes
    kept(text)              record what the stopped work kept, for the one line the CLI prints

Why a thread and not a deferring signal handler: Prefect acknowledges a deployment's cancellation only while
its own SIGTERM handler is installed (prefect.utilities.engine.commit_control_intent_and_ack checks it by
identity); replacing it, even for a while, turns the UI's stop button into a Crashed run. So the handlers stay
as their owners installed them (the CLI's, Prefect's), and the work that must finish its step runs beside them.
"""
from __future__ import annotations

import contextvars
import signal
import threading

_state = {"signum": 0, "kept": [], "file": None, "on_stop": []}


class Interrupted(BaseException):
    """The run stopped on request (a BaseException, like KeyboardInterrupt: never caught as an error)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def request_stop(signum: int = signal.SIGINT) -> None:
    first = not _state["signum"]
    _state["signum"] = _state["signum"] or int(signum)
    for tell in list(_state["on_stop"]) if first else ():
        tell(_state["signum"])


def stop_requested() -> int:
    if not _state["signum"] and _state["file"]:  # a process of a multi-process run: asked through a file
        try:
            _state["signum"] = int(open(_state["file"]).read().strip() or signal.SIGINT)
        except (FileNotFoundError, ValueError):
            pass
    return _state["signum"]


def watch(path) -> None:
    """A training process started by the node (tasks/training/distributed.py): its parent asks it to stop by writing
    the signal's number to `path` (the processes run in a session of their own; a terminal's Ctrl-C does not reach
    them, so all of them stop after the same step, their checkpoint stored)."""
    _state["file"] = str(path)


def on_stop(tell) -> None:
    """tell(signum) when a stop is first requested in this process (the node's launcher passes it on)."""
    _state["on_stop"].append(tell)
    if _state["signum"]:
        tell(_state["signum"])


def off_stop(tell) -> None:
    if tell in _state["on_stop"]:
        _state["on_stop"].remove(tell)


def _signum_of(exc: BaseException) -> int:
    """The signal behind an exception a handler raised: ours, Prefect's TerminationSignal, KeyboardInterrupt."""
    signum = getattr(exc, "signum", None) or getattr(exc, "signal", None)
    return int(signum) if signum else int(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)


def until_safe_point(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a thread of its own, with the caller's context (Prefect's run context, so its
    log lines still reach the flow run). The main thread waits; when a signal handler raises there (the CLI's
    Interrupted, Prefect's TerminationSignal, KeyboardInterrupt), the stop flag is set, fn ends at its next
    check (a training step's end, its checkpoint stored), and the handler's exception is raised again, so its
    owner decides what it means (exit 130/143; a cancelled flow run). A second signal while waiting is raised
    at once (the thread is a daemon: the process can exit without it)."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)  # signals only reach the main thread: nothing to wait beside
    out: dict = {}
    context = contextvars.copy_context()
    # An event of our own, not Thread.join: on CPython 3.11 a signal handler raising inside join() marks a running
    # thread as stopped (threading's bpo-45274 clean-up releases the lock the live thread holds), so is_alive()
    # says False and the run would exit before the step's checkpoint is stored. Event.wait has no such clean-up.
    began, finished = threading.Event(), threading.Event()

    def work() -> None:
        began.set()
        try:
            out["value"] = context.run(fn, *args, **kwargs)
        except BaseException as e:  # handed to the main thread as it is
            out["error"] = e
        finally:
            finished.set()

    worker = threading.Thread(target=work, name="loraflow-until-safe-point", daemon=True)
    try:
        worker.start()  # inside: a signal can come while start() waits for the thread to be running
        while not finished.wait(0.2):
            pass
    except BaseException as e:
        request_stop(_signum_of(e))
        # fn runs (or is about to) unless start() was stopped before it launched the thread: then there is no step
        if worker.ident is not None or began.wait(1.0):
            while not finished.wait(0.2):
                pass
        raise
    if "error" in out:
        raise out["error"]
    return out["value"]


def raise_if_requested() -> None:
    if _state["signum"]:
        raise Interrupted(_state["signum"])


def kept(text: str) -> None:
    _state["kept"].append(text)


def kept_items() -> list[str]:
    return list(_state["kept"])


def reset() -> None:
    _state.update(signum=0, kept=[], file=None, on_stop=[])
