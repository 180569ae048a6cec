"""train.resume=auto: a training run killed after a checkpoint continues from it, and the final LoRA
equals an uninterrupted run's bytes (CPU)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tasks import cache_latents, cache_text, train, validate
from tasks.config import compose, resolve_paths
from tasks.store import Store

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["train.max_steps=8", "train.save_every_n_steps=2", "train.log_every=2", "sample.steps=2"]

# The plain node functions; the process SIGKILLs itself right after the step-4 checkpoint is stored.
_KILL_SCRIPT = """
import os, signal, sys
from tasks import cache_latents, cache_text, train, validate
from tasks.config import compose, resolve_paths
from tasks.store import Store

real = train._save_checkpoint
def save_then_die(store, key, step, *args, **kwargs):
    real(store, key, step, *args, **kwargs)
    if step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
train._save_checkpoint = save_then_die

cfg = resolve_paths(compose("train", [f"store.root={sys.argv[1]}", *sys.argv[2:]])[0])
store = Store(cfg.store.root)
plan = validate.run(cfg, store)
latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
train.run(cfg, plan, store, latents["items"], texts["items"])
"""


def _train(store_root: Path) -> dict:
    cfg = resolve_paths(compose("train", [f"store.root={store_root}", *OVERRIDES])[0])
    store = Store(store_root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return train.run(cfg, plan, store, latents["items"], texts["items"])


def test_killed_training_resumes_exactly(tmp_path):
    store_root = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(store_root), *OVERRIDES], cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not list((store_root / train.KIND).rglob("manifest.json"))  # no LoRA was finished

    resumed = _train(store_root)
    assert resumed["continued_from_step"] == 4 and resumed["computed"] == 1
    straight = _train(tmp_path / "fresh")
    assert straight["continued_from_step"] is None
    assert Path(resumed["lora"]).read_bytes() == Path(straight["lora"]).read_bytes()
    assert resumed["losses"] == straight["losses"]
