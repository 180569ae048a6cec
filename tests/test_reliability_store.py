"""Corruption, a full disk and planted pickles, through the real flow (reliability campaign).

Every kind the flow stores (models, latents, text, checkpoints, lora, lora_kohya, lora_diffusers, samples) and the run
record are truncated, flipped or replaced by a pickle with a matching manifest; the next run detects each
(digest, manifest self-check, or format header), recomputes it to the same bytes and lists it in
report.json `repaired`. A full disk (ENOSPC injected into the store's writes, or a real tiny tmpfs where
one can be mounted) is a clear error that leaves no partial entry; the next run completes."""
from __future__ import annotations

import errno
import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import shared_api_url
from faults import REPO, child, data_of, debris, entries, flip, largest_file, snapshot, truncate
from tasks.store.hashing import digest_file, digest_tree
from tasks.store import Store, StoreFull, track_repairs
from tasks.store.store import _manifest_check

KINDS = ("models", "latents", "text", "checkpoints", "lora", "lora_kohya", "lora_diffusers", "samples")
FAULTS = ("flip-data", "truncate-data", "flip-manifest", "truncate-manifest", "pickle")


class _Evil:
    """Unpickling this creates the marker file: a pickle that runs code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant_pickle(entry: Path, marker: Path) -> None:
    """Replaces the entry's data (a model's largest file) by a pickle, with a manifest that matches it."""
    data = data_of(entry)
    largest_file(data).write_bytes(pickle.dumps(_Evil(marker)))
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["sha256"] = digest_tree(data) if data.is_dir() else digest_file(data)
    manifest["size"] = sum(p.stat().st_size for p in data.rglob("*") if p.is_file()) if data.is_dir() \
        else data.stat().st_size
    manifest["check"] = _manifest_check(manifest)
    (entry / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("fault", FAULTS)
def test_corrupt_artifacts_of_every_kind_are_recomputed_and_reported(workspace, fault):
    before = snapshot(workspace.store)
    stored = entries(workspace.store)
    victims = [sorted(k for k in before if k.startswith(f"{kind}/"))[0] for kind in KINDS]
    marker = workspace.root / "pickle-ran"
    for name in victims:
        entry = stored[name]
        target = entry / "manifest.json" if fault.endswith("manifest") else largest_file(data_of(entry))
        if fault == "pickle":
            _plant_pickle(entry, marker)
        elif fault.startswith("flip"):
            flip(target, 0x01 if fault.endswith("manifest") else 0xFF)  # a manifest stays valid UTF-8/JSON-ish
        else:
            truncate(target)
    record = workspace.store / "runs" / "train.json"
    if fault == "pickle":  # the last-run record (no manifest): corrupt reads as "no previous run"
        record.write_bytes(pickle.dumps(_Evil(marker)))
    elif not fault.endswith("manifest"):
        (flip if fault.startswith("flip") else truncate)(record)

    report = workspace.run()
    assert not marker.exists()  # no pickle was ever loaded
    expected = set(victims) | ({"runs/train"} if not fault.endswith("manifest") else set())
    assert set(report["repaired"]) == expected
    nodes = report["nodes"]
    for node, kind in (("cache_latents", "latents"), ("cache_text", "text"), ("train", "lora"), ("sample", "samples")):
        key = next(v for v in victims if v.startswith(f"{kind}/")).split("/")[1]
        assert nodes[node]["repaired"] == [key] and nodes[node]["computed"] == 1, node
    assert nodes["train"].get("continued_from_step") is None  # its checkpoint was corrupt too: trained again
    assert snapshot(workspace.store) == before  # every repaired artifact has its original bytes: nothing lost
    store = Store(workspace.store)
    assert all(store.valid(*name.split("/")) for name in entries(workspace.store))
    assert debris(workspace.store) == []
    assert store.read_record("train") is not None  # rewritten, valid


def test_corrupt_sample_rendered_during_training_is_rendered_again(workspace):
    """Samples rendered at checkpoints belong to the stored LoRA (its manifest lists them): a corrupt one is
    never published; training continues from the checkpoint before it and renders it again."""
    settings = ("sample.every_n_steps=6", "train.save_every_n_steps=4")
    first = workspace.run(*settings)
    lora_key = first["nodes"]["train"]["key"]
    rendered = Store(workspace.store).meta("lora", lora_key)["checkpoint_samples"]
    victim = Path(rendered["6"][1]["path"])
    before, published = snapshot(workspace.store), Path(first["artifacts"]["checkpoint_samples"]["6"][1])
    flip(victim)

    report = workspace.run(*settings)
    assert {f"samples/{victim.parent.name}", f"lora/{lora_key}"} <= set(report["repaired"])
    assert report["nodes"]["train"]["continued_from_step"] == 4  # steps 1-4 are not trained again
    assert snapshot(workspace.store) == before
    assert Path(report["artifacts"]["checkpoint_samples"]["6"][1]).read_bytes() == published.read_bytes()


def test_corrupt_digest_memo_is_recomputed(tmp_path):
    """Digests of big files (model weights) are memoised in <store>/filedigests: a torn or flipped memo is
    noticed and the file digested again, never a wrong digest used."""
    big = tmp_path / "weights.safetensors"
    big.write_bytes(bytes(range(256)) * (17 << 12))  # 17 MiB: over the memo threshold
    store, truth = Store(tmp_path / "store"), digest_file(big)
    assert store.file_digest(big) == truth
    (memo,) = (tmp_path / "store" / "filedigests").iterdir()
    for corrupt in (flip, truncate, lambda p: p.write_text(f"{'0' * 64} {'0' * 16}\n")):  # torn, flipped, wrong
        corrupt(memo)
        repairs = track_repairs()
        assert store.file_digest(big) == truth
        assert repairs == [f"filedigests/{memo.stem}"]
        assert store.file_digest(big) == truth and len(repairs) == 1  # the rewritten memo is good


# -- a full disk -----------------------------------------------------------------------------------
def _fill_disk_on(monkeypatch, kind: str, after: int, where: str = "data", error=None):
    """The store's (after+1)-th write of `kind` gets half its bytes on disk, then ENOSPC."""
    import tasks.store.store as store_mod

    error = error or OSError(errno.ENOSPC, "No space left on device")
    seen = {"n": 0}
    real_put, real_write_bytes = Store.put, store_mod._write_bytes

    def put(self, k, key, ext, write, meta=None, **kw):
        if k != kind:
            return real_put(self, k, key, ext, write, meta, **kw)
        seen["n"] += 1
        if seen["n"] != after + 1:
            return real_put(self, k, key, ext, write, meta, **kw)
        if where == "manifest":
            def write_bytes(path, data):
                if path.name == "manifest.json":
                    path.write_bytes(data[: len(data) // 2])
                    raise error
                return real_write_bytes(path, data)
            monkeypatch.setattr(store_mod, "_write_bytes", write_bytes)
            try:
                return real_put(self, k, key, ext, write, meta, **kw)
            finally:
                monkeypatch.setattr(store_mod, "_write_bytes", real_write_bytes)

        def half_then_full(path):
            write(path)
            truncate(largest_file(path))
            raise error
        return real_put(self, k, key, ext, half_then_full, meta, **kw)

    monkeypatch.setattr(Store, "put", put)


def _safetensors_full():
    from safetensors import SafetensorError  # what safetensors raises on a full disk

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


# (kind, finished before the disk fills, where, edit forcing new work, node, expected counts of the re-run)
DISK_FULL = [("latents", 3, "data", "data.resolution=48", "cache_latents", (9, 3)),
             ("lora", 0, "data", "train.lr=3e-3", "train", (1, 0)),
             ("samples", 1, "manifest", "sample.seed=7", "sample", (2, 1))]


@pytest.mark.parametrize("kind,after,where,edit,node,counts", DISK_FULL, ids=[d[0] for d in DISK_FULL])
def test_disk_full_is_a_clear_error_then_the_next_run_completes(workspace, monkeypatch, kind, after, where, edit,
                                                               node, counts):
    before = set(entries(workspace.store))
    _fill_disk_on(monkeypatch, kind, after, where, _safetensors_full() if kind == "latents" else None)
    with pytest.raises(StoreFull) as err:
        workspace.run(edit)
    message = str(err.value)
    assert "disk is full" in message and str(Store(workspace.store).root) in message and kind in message
    new = set(entries(workspace.store)) - before
    assert sum(n.startswith(f"{kind}/") for n in new) == after  # finished items kept, no partial entry
    assert all(Store(workspace.store).valid(*n.split("/")) for n in new)
    assert debris(workspace.store) == []

    monkeypatch.undo()  # space again
    report = workspace.run(edit)
    entry = report["nodes"][node]
    assert (entry["computed"], entry["reused"]) == counts
    if kind == "lora":  # the final checkpoint was stored before the disk filled: no step is trained again
        assert entry["continued_from_step"] == 12
    assert debris(workspace.store) == []


_CLI_FULL = """
import errno, sys
from tasks.store import Store
real = Store.put
def full(path):
    raise OSError(errno.ENOSPC, "No space left on device")
def put(self, kind, key, ext, write, meta=None, **kw):
    return real(self, kind, key, ext, full if kind == "latents" else write, meta, **kw)
Store.put = put
import runpy
sys.argv = ["flows.train", *sys.argv[1:]]
runpy.run_module("flows.train", run_name="__main__", alter_sys=True)
"""


def test_cli_says_the_disk_is_full(tmp_path):
    store = tmp_path / "store"
    proc = child(_CLI_FULL, f"store.root={store}", f"hydra.run.dir={tmp_path / 'run'}", "train.max_steps=2",
                 env={"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": shared_api_url()}, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:]
    said = re.search(r"loraflow: stopped: .*the disk is full.*" + re.escape(str(store)), proc.stdout)
    assert said, proc.stdout[-3000:]
    assert not list(store.glob("latents/*/*/manifest.json")) and debris(store) == []


def test_real_full_tmpfs(tmp_path):
    """A real 256 KiB tmpfs (needs root to mount; skipped otherwise): safetensors, copies and PNGs."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        from PIL import Image

        store = Store(small / "store")
        big = tmp_path / "big.bin"
        big.write_bytes(b"\x01" * (400 << 10))
        writes = [lambda: store.put_tensors("latents", "a" * 64, {"x": torch.ones(100_000)}),
                  lambda: store.put_file("samples", "b" * 64, big),
                  lambda: store.put("samples", "c" * 64, ".png", lambda p: Image.frombytes(
                      "RGB", (512, 512), os.urandom(512 * 512 * 3)).save(p))]
        for write in writes:
            with pytest.raises(StoreFull, match="disk is full"):
                write()
            assert entries(store.root) == {} and debris(store.root) == []
        store.put_tensors("latents", "a" * 64, {"x": torch.ones(1000)})  # space for a small one: written
        assert store.valid("latents", "a" * 64)
    finally:
        subprocess.run(["umount", str(small)], check=True)


# -- nothing loads a pickle ------------------------------------------------------------------------
_UNSAFE = [r"\bpickle\.loads?\(", r"\bcloudpickle\b", r"\bimport dill\b", r"\bjoblib\.load\(",
           r"allow_pickle\s*=\s*True", r"\bread_pickle\(", r"\byaml\.(unsafe_)?load\((?![^)]*SafeLoader)",
           r"torch\.load\((?![^)]*weights_only\s*=\s*True)"]


def test_no_code_loads_a_pickle():
    hits = []
    for folder in ("tasks", "flows", "scripts", "bench", "deploy"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if "third_party" in path.relative_to(REPO).parts:  # another project's source (bench/musubi_source.sh)
                continue
            text = path.read_text()
            hits += [f"{path.relative_to(REPO)}: {m.group(0)}" for rx in _UNSAFE for m in re.finditer(rx, text)]
    assert hits == []
    # Prefect persists node results as JSON, never pickles (its default serializer)
    from flows import nodes

    for task in (nodes.cache_latents_task, nodes.cache_text_task, nodes.train_task, nodes.sample_task):
        assert task.result_serializer == "json", task.name
    assert nodes.validate_task.persist_result is False
