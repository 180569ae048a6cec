"""What killed processes leave under <store>/tmp is removed by the next run; a write in progress never is."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from faults import KILL_AT, OVERRIDES, child, debris, pipeline

from tasks.store import debris as debris_mod
from tasks.store import Store


def _entry(tmp, name: str, age_s: float = 0.0, size: int = 1000):
    path = tmp / name
    path.mkdir()
    (path / "data.safetensors").write_bytes(b"\0" * size)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return name


def test_sweep_removes_only_entries_whose_owner_is_gone(tmp_path):
    store = Store(tmp_path / "store")
    tmp = store.root / "tmp"
    host, sep = socket.gethostname(), debris_mod.SEP
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                            text=True).stdout.strip()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = {_entry(tmp, sep.join(("latents-ab", host, exited, "x1"))),               # owner exited
                _entry(tmp, sep.join(("text-cd", "other-host", "12", "x2")), age_s=3 * 86400),  # old, foreign
                _entry(tmp, "latents-ef-0123abcd", age_s=2 * 86400)}                     # old, no owner
        own = store.tmp_path("lora-12")  # a write of this process, in progress
        own.mkdir()
        kept = {_entry(tmp, sep.join(("train", host, str(running.pid), "x3")), age_s=9 * 86400),  # running
                own.name,
                _entry(tmp, sep.join(("text-cd", "other-host", "12", "x4")), age_s=600),  # young, foreign
                _entry(tmp, "samples-0123", age_s=60)}                                    # young, no owner
        assert store.sweep_debris() == (3, 3000)
        assert set(os.listdir(tmp)) == kept and not gone & set(os.listdir(tmp))
    finally:
        running.kill()
        running.wait()
    assert store.sweep_debris()[0] == 1  # the sleeper's entry, now that it has exited


def test_the_next_run_removes_what_a_kill_left(tmp_path):
    root = tmp_path / "store"
    proc = child(KILL_AT + "from faults import pipeline\npipeline(sys.argv[3], sys.argv[4:])\n",
                 "latents", 2, root, *OVERRIDES)
    assert proc.returncode == -9, proc.stderr[-3000:]
    left = debris(root)
    assert len(left) == 1 and left[0].startswith("latents-")  # the torn write
    pipeline(root, OVERRIDES, stop_after="cache_text")
    assert debris(root) == []
