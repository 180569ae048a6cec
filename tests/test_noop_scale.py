"""A no-op re-run that stays cheap at 100,000 items (issue 20, item 3): images unchanged since the last run are
not decoded or digested again (tasks/data/image_memo.py), store entries whose files are unchanged are not read
(tasks/store/entry_index.py), and Prefect's parameters and results hold keys, not items. Counts, never times
(the figure is bench/noop_scale.py's)."""
from __future__ import annotations

import os
import random
import time

import pytest

from tasks.data import image_memo
from tasks.store.hashing import digest_file, key_of, key_of_hex
from tasks.store import Store

OLD = time.time() - 3600  # older than the memo's racy window


def test_key_of_hex_is_key_of():
    rng = random.Random(0)
    for n in (0, 1, 2, 5):
        parts = [f"{rng.getrandbits(256):064x}" for _ in range(n)]
        assert key_of_hex(parts) == key_of(parts)


def _decodes(monkeypatch) -> list:
    calls = []
    real = image_memo.decode_image

    def counted(path, data=None):
        calls.append(str(path))
        return real(path, data)
    monkeypatch.setattr(image_memo, "decode_image", counted)
    return calls


def _images(tmp_path, n=4):
    from PIL import Image

    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(n):
        Image.new("RGB", (32, 32), (i * 40, 10, 10)).save(folder / f"img_{i}.png")
        (folder / f"img_{i}.txt").write_text(f"caption {i}")
        os.utime(folder / f"img_{i}.png", (OLD, OLD))
    return folder


def test_unchanged_images_are_not_decoded_again(tmp_path, monkeypatch):
    from tasks.data.dataset import check_dataset
    from tasks.data.image_memo import ImageMemo

    folder, store = _images(tmp_path), tmp_path / "store"
    calls = _decodes(monkeypatch)

    def check():
        memo = ImageMemo(store, folder)
        items = check_dataset(folder, memo=memo).items
        memo.save(lambda path, data: path.write_bytes(data))
        return items

    first = check()
    assert len(calls) == 4
    assert [it.digest for it in first] == [digest_file(it.image_path) for it in first]
    calls.clear()
    assert [(it.name, it.digest, it.size) for it in check()] == [(it.name, it.digest, it.size) for it in first]
    assert calls == []  # every image answered by its stat signature

    from PIL import Image

    Image.new("RGB", (40, 32), (1, 2, 3)).save(folder / "img_2.png")  # edited now: inside the racy window
    calls.clear()
    edited = {it.name: it for it in check()}
    assert calls == [str(folder / "img_2.png")]
    assert edited["img_2.png"].size == (40, 32) and edited["img_2.png"].digest == digest_file(folder / "img_2.png")
    calls.clear()
    check()
    assert calls == [str(folder / "img_2.png")]  # changed within 2 s of the check: never remembered (racy)
    os.utime(folder / "img_2.png", (OLD, OLD))
    check()
    calls.clear()
    check()
    assert calls == []

    memo_file = next((store / "index" / "images").glob("*.json"))
    memo_file.write_bytes(memo_file.read_bytes()[:-20])  # torn: ignored, every image read again
    calls.clear()
    check()
    assert len(calls) == 4


def test_unchanged_entries_are_not_read_and_a_changed_one_is(tmp_path, monkeypatch):
    import torch

    store = Store(tmp_path / "store")
    keys = [key_of({"i": i}) for i in range(3)]
    for k in keys:
        store.put_tensors("latents", k, {"latents": torch.full((2, 2), float(len(k)))}, recomputable=True)
    store.save_indexes()

    reads = []
    real = Store.verify
    monkeypatch.setattr(Store, "verify", lambda self, kind, key: reads.append(key) or real(self, kind, key))
    fresh = Store(tmp_path / "store")  # another process: only the index file carries what was verified
    assert all(fresh.intact("latents", k) for k in keys) and reads == []

    data = fresh.entry_dir("latents", keys[1]) / "data.safetensors"
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 0xFF
    data.write_bytes(bytes(blob))  # same size, new mtime
    fresh = Store(tmp_path / "store")
    assert [fresh.intact("latents", k) for k in keys] == [True, False, True]
    assert reads == [keys[1]]  # verified in full, and found corrupt

    index = tmp_path / "store" / "index" / "latents" / f"{keys[0][:2]}.json"  # the shard of keys[0]
    sealed = index.read_bytes()  # "<sha256>\n<json>": a digest that does not match makes it ignored
    index.write_bytes(("0" if sealed[:1] != b"0" else "1").encode() + sealed[1:])
    reads.clear()
    fresh = Store(tmp_path / "store")
    assert fresh.intact("latents", keys[0]) and reads == [keys[0]]


@pytest.fixture
def warm(workspace):
    workspace.run()  # the copy's files have new inodes: this run remembers them
    return workspace


def test_a_noop_reads_no_entry_decodes_no_image_and_passes_prefect_keys(warm, monkeypatch):
    from prefect.tasks import Task

    calls = _decodes(monkeypatch)
    reads = []
    real = Store.verify
    monkeypatch.setattr(Store, "verify", lambda self, kind, key: reads.append(kind) or real(self, kind, key))
    params = []
    real_call = Task.__call__

    def recorded(self, *args, **kwargs):
        params.append((self.name, kwargs))
        return real_call(self, *args, **kwargs)
    monkeypatch.setattr(Task, "__call__", recorded)

    report = warm.run()
    assert all(report["nodes"][n]["status"] == "cached" for n in ("cache_latents", "cache_text", "train", "sample"))
    assert calls == []
    assert "latents" not in reads and "text" not in reads
    for name, kwargs in params:  # Prefect sees keys and the config, never the dataset's items
        if name != "validate":
            assert set(kwargs) - {"return_state", "cfg", "run_dir"} <= {"key", "plan", "latents", "texts", "lora"}
            assert all(isinstance(kwargs[k], str) for k in kwargs if k not in ("return_state", "cfg"))
