"""Batches prepared one step ahead in a thread (the CUDA path, forced here on the CPU) train the LoRA bytes
that the same batches prepared in the loop train: the caption choice, noise and timestep of every item come
from its own generator, whichever thread draws first."""
from __future__ import annotations

import threading
from pathlib import Path

from faults import pipeline

import tasks.train
from tasks.store import Store

# Cached caption variants with dropout and shuffling: every step draws a caption choice from the item's
# generator before the loss draws noise and timestep from it.
AUGMENTED = ["train.max_steps=6", "train.batch_size=2", "data.shuffle_caption=true",
             "data.caption_dropout_rate=0.3", "text.variants=3", "sample.steps=2"]


def test_prefetched_batches_train_the_same_lora(tmp_path, monkeypatch):
    inline = pipeline(tmp_path / "inline", AUGMENTED, stop_after="train")

    readers: set[str] = set()
    get_tensors = Store.get_tensors

    def recording(self, kind, key):
        if kind == "text":
            readers.add(threading.current_thread().name)
        return get_tensors(self, kind, key)

    monkeypatch.setattr(tasks.train, "overlap_loading", lambda: True)
    monkeypatch.setattr(Store, "get_tensors", recording)
    ahead = pipeline(tmp_path / "ahead", AUGMENTED, stop_after="train")

    assert readers and threading.main_thread().name not in readers  # text was read by the loader thread
    assert ahead["train"]["losses"] == inline["train"]["losses"]
    assert Path(ahead["train"]["lora"]).read_bytes() == Path(inline["train"]["lora"]).read_bytes()
