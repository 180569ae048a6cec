"""A run killed in the middle of a node: nothing half-written is read later, finished items are kept."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tasks import cache_latents, validate
from tasks.config import compose, resolve_paths
from tasks.store import Store

REPO = Path(__file__).resolve().parents[1]

# Runs validate + cache_latents as plain functions; the 5th latent write is killed half-way through.
_KILL_SCRIPT = """
import os, signal, sys
from tasks import cache_latents, validate
from tasks.config import compose, resolve_paths
from tasks.store import Store

real_put, calls = Store.put, []
def put(self, kind, key, ext, write, meta=None, **kw):
    calls.append(key) if kind == "latents" else None
    if kind == "latents" and len(calls) == 5:
        def torn(path):
            path.write_bytes(b"\\x00" * 17)  # a torn write
            os.kill(os.getpid(), signal.SIGKILL)
        return real_put(self, kind, key, ext, torn, meta, **kw)
    return real_put(self, kind, key, ext, write, meta, **kw)
Store.put = put

cfg = resolve_paths(compose("train", [f"store.root={sys.argv[1]}"])[0])
store = Store(cfg.store.root)
cache_latents.run(cfg, validate.run(cfg, store), store)
"""


def test_kill_mid_cache_latents_then_rerun(tmp_path):
    store_root = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(store_root)], cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    store = Store(store_root)
    manifests = list((store_root / "latents").rglob("manifest.json"))
    assert len(manifests) == 4  # the four finished items, and no entry for the torn one
    assert all(store.valid("latents", m.parent.name) for m in manifests)

    cfg = resolve_paths(compose("train", [f"store.root={store_root}"])[0])
    result = cache_latents.run(cfg, validate.run(cfg, store), store)
    assert (result["computed"], result["reused"]) == (8, 4)  # finished items are not recomputed
    assert all(store.valid("latents", k) for k in result["items"].values())


def test_train_never_loads_vae_or_text_encoders(workspace, monkeypatch):
    from tasks.models.flux import FluxAdapter

    def forbidden(self):
        raise AssertionError("the train node must work from cached tensors only")

    monkeypatch.setattr(FluxAdapter, "load_vae", forbidden)
    monkeypatch.setattr(FluxAdapter, "load_text_encoders", forbidden)
    r = workspace.run("train.lr=3e-3")
    assert r["nodes"]["train"]["status"] == "ran" and r["nodes"]["sample"]["computed"] == 3
