"""How the train node reads its batches changes nothing it trains. Batches prepared one step ahead in a
thread (the CUDA path, forced here on the CPU) train the LoRA bytes that batches prepared in the loop
train: the caption choice, noise and timestep of every item come from its own generator, whichever thread
draws first. Latents read again from the store (a dataset bigger than the memo) train the same bytes too."""
from __future__ import annotations

import threading
from pathlib import Path

from faults import pipeline

import tasks.train
import tasks.training.batches
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


def test_latents_beyond_the_memo_are_read_again_and_train_the_same_lora(tmp_path, monkeypatch):
    two_epochs = [o for o in AUGMENTED if not o.startswith("train.max_steps=")] + ["train.max_steps=14"]
    whole = pipeline(tmp_path / "whole", two_epochs, stop_after="train")

    reads = []
    get_tensors = Store.get_tensors

    def counting(self, kind, key):
        reads.append(kind)
        return get_tensors(self, kind, key)

    monkeypatch.setattr(tasks.training.batches, "MEMO_ITEMS", 2)
    monkeypatch.setattr(Store, "get_tensors", counting)
    small = pipeline(tmp_path / "small", two_epochs, stop_after="train")

    images = len(small["cache_latents"]["items"])
    assert reads.count("latents") > images and reads.count("text") > 3  # evicted items were read again
    assert small["train"]["losses"] == whole["train"]["losses"]
    assert Path(small["train"]["lora"]).read_bytes() == Path(whole["train"]["lora"]).read_bytes()
