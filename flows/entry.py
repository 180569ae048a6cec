"""`loraflow`, the console script, and `python -m flows.train`: the CLI's start-up and exit.

Start-up: no garbage collection while the CLI's modules import, then the objects they made (~140,000, alive
until exit) are frozen, so no later collection walks them (a no-op run: 0.4 s less on 2 cores).
Exit: as Python's own (non-daemon threads joined, the exit handlers run: Prefect's log and event workers
drained, a temporary API server stopped, logging flushed), then `os._exit`, skipping the teardown of the
interpreter's ~2,000 modules one object at a time (65 ms of a no-op run on 2 cores; the process ends anyway).
bench/RESULTS.md, figure 6."""
from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn


def main() -> None:
    from tasks.lazy import collector_paused

    with collector_paused():
        from flows.cli import main as cli_main
    run_and_exit(cli_main)


def run_and_exit(cli_main: Callable[[], object]) -> NoReturn:
    """Run the CLI and end the process with its status. An exception other than SystemExit, an exit with a
    message (Python prints it, status 1), or a run under a profiler or tracer (`python -m cProfile`, which
    writes its file after the program) leaves the usual way."""
    import atexit
    import threading

    try:
        cli_main()
        status = 0
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            raise
        status = e.code or 0
    if sys.getprofile() is not None or sys.gettrace() is not None:  # cProfile, a debugger: they write at exit
        sys.exit(status)
    threading._shutdown()  # what Python's exit does first: thread pools' exit hooks, non-daemon threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    os._exit(status & 0xFF)  # as the OS reads any exit status
