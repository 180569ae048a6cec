"""The artifact store: atomic writes, verified reads, kill safety, concurrent writers, no pickles."""
from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tasks.store.hashing import changed_inputs, digest_tree, key_of
from tasks.store import CorruptArtifact, Store


def test_key_covers_every_input_and_is_order_free():
    a = {"image": "d1", "size": [64, 64], "lr": 1e-4}
    assert key_of(a) == key_of(dict(reversed(list(a.items()))))
    for name, other in (("image", "d2"), ("size", [64, 48]), ("lr", 1.0001e-4)):
        assert key_of({**a, name: other}) != key_of(a), name
    assert changed_inputs(a, {**a, "lr": 2e-4, "new": 1}) == ["lr", "new"]
    assert changed_inputs(None, a) == []


def test_tree_digest_ignores_location(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d / "sub").mkdir(parents=True)
        (tmp_path / d / "sub" / "w.bin").write_bytes(b"weights")
    assert digest_tree(tmp_path / "a") == digest_tree(tmp_path / "b")
    (tmp_path / "b" / "sub" / "w.bin").write_bytes(b"weightz")
    assert digest_tree(tmp_path / "a") != digest_tree(tmp_path / "b")


def test_tensors_round_trip_and_corruption_is_detected(tmp_path):
    store = Store(tmp_path)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = store.put_tensors("latents", "k" * 64, {"latents": t}, meta={"image": "a.png"})
    assert torch.equal(store.get_tensors("latents", "k" * 64)["latents"], t)
    assert store.meta("latents", "k" * 64) == {"image": "a.png"}
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip one byte of the tensor data
    path.write_bytes(bytes(data))
    assert not store.valid("latents", "k" * 64)
    with pytest.raises(CorruptArtifact):
        store.get_tensors("latents", "k" * 64)
    path.write_bytes(bytes(data[:10]))  # truncated
    assert not store.valid("latents", "k" * 64)
    store.put_tensors("latents", "k" * 64, {"latents": t})  # a rewrite replaces the corrupt entry
    assert store.valid("latents", "k" * 64)


def test_missing_entry_is_not_valid(tmp_path):
    store = Store(tmp_path)
    assert not store.exists("text", "0" * 64) and not store.valid("text", "0" * 64)


_KILLED_WRITER = """
import os, signal, sys
from tasks.store import Store
store = Store(sys.argv[1])
def write(path):
    with open(path, "wb") as f:
        f.write(b"half of an artifact")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)   # killed mid-write
store.put("latents", "a" * 64, ".safetensors", write)
"""


def test_killed_writer_leaves_nothing_readable(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], cwd=Path(__file__).parents[1])
    assert proc.returncode == -9
    store = Store(tmp_path)
    assert not store.exists("latents", "a" * 64)
    assert not store.valid("latents", "a" * 64)
    assert not (tmp_path / "latents").exists() or not any((tmp_path / "latents").rglob("manifest.json"))
    store.put_tensors("latents", "a" * 64, {"latents": torch.zeros(2)})  # a later run writes it normally
    assert store.valid("latents", "a" * 64)


def test_concurrent_writers_of_one_key(tmp_path):
    store = Store(tmp_path)
    t = torch.ones(64, 64)
    errors = []

    def write():
        try:
            Store(tmp_path).put_tensors("latents", "c" * 64, {"latents": t})
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert torch.equal(store.get_tensors("latents", "c" * 64)["latents"], t)
    assert os.listdir(tmp_path / "tmp") == []  # no debris


def test_a_planted_pickle_is_refused_not_executed(tmp_path):
    store = Store(tmp_path)
    store.put_tensors("latents", "p" * 64, {"latents": torch.zeros(1)})
    path = store.get_path("latents", "p" * 64)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CorruptArtifact):
        store.get_tensors("latents", "p" * 64)
    assert not marker.exists()


def test_records_round_trip(tmp_path):
    store = Store(tmp_path)
    assert store.read_record("train") is None
    store.write_record("train", {"inputs": {"a": 1}})
    assert store.read_record("train") == {"inputs": {"a": 1}}


@pytest.mark.parametrize("text", ["ascii", "non-ascii"])
def test_canonical_safetensors_header(tmp_path, text):
    """safetensors writes metadata in hash order; canonicalizing gives the same bytes for the same content. The
    sorted header is as long as safetensors' own (compact JSON): only it is written again, the file stays the same
    file (its tensors neither read nor copied); a caption in another script makes it longer (Python escapes it):
    then a new file, the same canonical bytes."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from tasks.store.stored_files import canonicalize_safetensors

    tensors = {"b": torch.arange(5.0), "a": torch.ones(3, 2)}
    meta = {f"k{i}": str(i) if text == "ascii" else f"caf\u00e9 {i} \u732b" for i in range(20)}
    files = []
    for i, order in enumerate((meta, dict(reversed(list(meta.items()))))):
        p = tmp_path / f"{i}.safetensors"
        save_file(tensors, str(p), metadata=order)
        inode = p.stat().st_ino
        canonicalize_safetensors(p)
        assert (p.stat().st_ino == inode) == (text == "ascii")
        files.append(p)
    assert files[0].read_bytes() == files[1].read_bytes()
    (n,) = struct.unpack("<Q", files[0].read_bytes()[:8])
    header = json.loads(files[0].read_bytes()[8:8 + n])
    offsets = [header[k]["data_offsets"][0] for k in list(header)[1:]]
    assert list(header)[0] == "__metadata__" and offsets == sorted(offsets) and set(header) == {"__metadata__", *tensors}
    assert list(header["__metadata__"]) == sorted(meta)
    loaded = load_file(files[0])
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with safe_open(str(files[0]), "pt") as f:
        assert f.metadata() == meta


def test_run_record_reads_both_forms_and_refuses_an_altered_one(tmp_path):
    import json

    from tasks.store.hashing import digest_text

    store, obj = Store(tmp_path), {"inputs": {"train": {"item:a.png": "0" * 64, "lr": 1e-4}}}
    store.write_record("train", obj)
    assert store.read_record("train") == obj
    path = tmp_path / "runs" / "train.json"
    old_text = json.dumps(obj, indent=1, sort_keys=True)  # the indented form records had before
    path.write_text(json.dumps({"record": obj, "sha256": digest_text(old_text)}, indent=1, sort_keys=True))
    assert store.read_record("train") == obj
    assert json.loads(path.read_text())["sha256"] == digest_text(json.dumps(obj, sort_keys=True))  # rewritten
    path.write_text(path.read_text().replace("0.0001", "0.001"))
    assert store.read_record("train") is None


def test_sealed_json_refuses_torn_or_altered_bytes_and_reads_the_form_before():
    import json

    import pytest

    from tasks.store.hashing import digest_text, sealed, unseal

    obj = {"b": [1, "x"], "a": {"k": 2.5}}
    assert unseal(sealed(obj)) == obj
    for bad in (sealed(obj)[:-3], sealed(obj).replace(b"2.5", b"2.6"), b"", b"0" * 64):
        with pytest.raises(ValueError):
            unseal(bad)
    before = json.dumps({"check": digest_text(json.dumps(obj, sort_keys=True, separators=(",", ":"))),
                         "entries": obj}).encode()
    assert unseal(before) == obj
