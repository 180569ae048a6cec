"""Fault injection for the reliability tests (tests/test_reliability_*.py): kills, torn and flipped files,
a full disk. Only the store's write path is wrapped; every node, model, file and process is real."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tasks.store.hashing import digest_file, digest_tree

REPO = Path(__file__).resolve().parents[1]
# Small enough to be quick, with checkpoints so finished steps survive a kill.
OVERRIDES = ["train.max_steps=8", "train.save_every_n_steps=2", "train.log_every=2", "sample.steps=2"]

# Prelude of a child process (argv[1]=kind, argv[2]=n): after n entries of that kind were committed, the
# next one is written in full and the process SIGKILLs itself before the entry is committed.
KILL_AT = """
import os, signal, sys
sys.path.insert(0, "tests")
from tasks.store import Store
_real_put, _kind, _n, _done = Store.put, sys.argv[1], int(sys.argv[2]), [0]
def _put(self, kind, key, ext, write, meta=None, **kw):
    if kind != _kind:
        return _real_put(self, kind, key, ext, write, meta, **kw)
    if _done[0] == _n:
        def torn(path):
            write(path)
            os.kill(os.getpid(), signal.SIGKILL)
        return _real_put(self, kind, key, ext, torn, meta, **kw)
    out = _real_put(self, kind, key, ext, write, meta, **kw)
    _done[0] += 1
    return out
Store.put = _put
"""


def pipeline(store_root, overrides=(), stop_after: str = "sample") -> dict:
    """The five nodes as plain functions, in order, against one store; their results by node name."""
    from tasks import cache_latents, cache_text, sample, train, validate
    from tasks.config import compose, resolve_paths
    from tasks.store import Store

    cfg = resolve_paths(compose("train", [f"store.root={store_root}", *overrides])[0])
    store = Store(cfg.store.root)
    plan = validate.run(cfg, store)
    out = {"cache_latents": cache_latents.run(cfg, plan, store), "cache_text": cache_text.run(cfg, plan, store)}
    if stop_after == "cache_text":
        return out
    out["train"] = train.run(cfg, plan, store, out["cache_latents"]["items"], out["cache_text"]["items"])
    if stop_after == "train":
        return out
    out["sample"] = sample.run(cfg, plan, store, out["train"]["key"], out["train"]["lora"], out["cache_text"]["items"])
    return out


def child(code: str, *args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs `python -c code args` in the repository, in its own process group, which is killed afterwards
    whatever happens (a killed CLI's temporary Prefect server is stopped by its guard, flows/console.py; this is
    the test's own sweep). Output goes through a file:
    an orphan holding a pipe open would block reading it. An `env` value of None removes that variable."""
    full_env = {k: v for k, v in {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}.items() if v is not None}
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, text=True, env=full_env,
                                start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        text = out.read()
    return subprocess.CompletedProcess(proc.args, proc.returncode, text, text)


def entries(store_root) -> dict[str, Path]:
    """"kind/key" -> entry folder, for every committed entry (one with a manifest)."""
    root = Path(store_root)
    return {f"{m.parent.parent.parent.name}/{m.parent.name}": m.parent
            for m in root.glob("*/*/*/manifest.json") if m.parent.parent.parent.name != "tmp"}


def data_of(entry: Path) -> Path:
    return entry / json.loads((entry / "manifest.json").read_text())["file"]


def snapshot(store_root, kinds=None) -> dict[str, str]:
    """"kind/key" -> sha256 of the entry's data bytes (a folder's tree digest), for every committed entry."""
    out = {}
    for name, entry in entries(store_root).items():
        if kinds is None or name.split("/")[0] in kinds:
            data = data_of(entry)
            out[name] = digest_tree(data) if data.is_dir() else digest_file(data)
    return out


def largest_file(path: Path) -> Path:
    return max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size) if path.is_dir() else path


def flip(path: Path, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= mask
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def debris(store_root) -> list[str]:
    tmp = Path(store_root) / "tmp"
    return sorted(os.listdir(tmp)) if tmp.is_dir() else []
