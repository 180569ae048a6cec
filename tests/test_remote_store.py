"""store.root as an fsspec URL: machines share one store through it (memory:// stands in for s3:// etc.)."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from tasks.config_schema import StoreConfig
from tasks.store.remote_store import RemoteStore, open_store
from tasks.store import Store

from conftest import FAST, REPO


@pytest.fixture
def url():
    root = f"memory://loraflow-test-{uuid.uuid4().hex}/store"
    yield root
    fs, base = fsspec.core.url_to_fs(root)
    if fs.exists(base):
        fs.rm(base, recursive=True)


def test_plain_paths_and_file_urls_are_the_local_store(tmp_path):
    assert type(open_store(StoreConfig(root=str(tmp_path / "a"), cache_dir=None))) is Store
    local = open_store(StoreConfig(root=f"file://{tmp_path / 'b'}", cache_dir=None))
    assert type(local) is Store and local.root == (tmp_path / "b").resolve()


def test_a_second_machine_reads_what_the_first_wrote(url, tmp_path):
    one = open_store(StoreConfig(root=url, cache_dir=str(tmp_path / "machine1")))
    assert isinstance(one, RemoteStore)
    t = torch.arange(6, dtype=torch.float32)
    one.put_tensors("latents", "a" * 64, {"latents": t}, meta={"image": "x.png"})
    one.put_json("misc", "b" * 64, {"hello": "world"})
    one.write_record("train", {"inputs": {"n": 1}})

    two = open_store(StoreConfig(root=url, cache_dir=str(tmp_path / "machine2")))
    assert not (two.entry_dir("latents", "a" * 64)).exists()  # nothing local yet
    assert two.exists("latents", "a" * 64) and two.valid("latents", "a" * 64)  # pulled and verified
    assert torch.equal(two.get_tensors("latents", "a" * 64)["latents"], t)
    assert two.meta("latents", "a" * 64) == {"image": "x.png"}
    assert two.get_json("misc", "b" * 64) == {"hello": "world"}
    assert two.read_record("train") == {"inputs": {"n": 1}}
    assert not two.exists("latents", "c" * 64)
    assert list((tmp_path / "machine2" / "tmp").iterdir()) == []  # no pull debris


def test_a_tampered_remote_object_is_caught_and_discarded(url, tmp_path):
    one = open_store(StoreConfig(root=url, cache_dir=str(tmp_path / "m1")))
    one.put_tensors("latents", "a" * 64, {"latents": torch.ones(4)})
    fs, base = fsspec.core.url_to_fs(url)
    remote_data = f"{base}/latents/aa/{'a' * 64}/data.safetensors"
    raw = bytearray(fs.cat_file(remote_data))
    raw[-1] ^= 0xFF
    fs.pipe_file(remote_data, bytes(raw))

    two = open_store(StoreConfig(root=url, cache_dir=str(tmp_path / "m2")))
    assert two.exists("latents", "a" * 64) and not two.valid("latents", "a" * 64)
    two.discard("latents", "a" * 64)  # what check_items does before recomputing
    assert not two.exists("latents", "a" * 64) and not fs.exists(f"{base}/latents/aa/{'a' * 64}")


def test_an_entry_without_its_remote_manifest_does_not_exist(url, tmp_path):
    fs, base = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{base}/latents/aa/{'a' * 64}/data.safetensors", b"half an upload")
    store = open_store(StoreConfig(root=url, cache_dir=str(tmp_path / "m")))
    assert not store.exists("latents", "a" * 64)


def test_flow_on_a_url_store_second_machine_recomputes_nothing(prefect_api, url, tmp_path):
    import shutil

    from flows.train import train_flow

    data, prompts = tmp_path / "data", tmp_path / "prompts.txt"
    shutil.copytree(REPO / "data" / "demo", data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)

    def run(machine: str) -> dict:
        out = train_flow("train", [f"data.dir={data}", f"sample.prompts_file={prompts}", f"store.root={url}",
                                   f"store.cache_dir={tmp_path / machine}", f"hydra.run.dir={tmp_path / ('run-' + machine)}",
                                   *FAST])
        return json.loads(Path(out["report"]).read_text())

    first = run("m1")
    assert first["nodes"]["train"]["status"] == "ran" and first["nodes"]["cache_latents"]["computed"] == 12
    second = run("m2")  # another machine: an empty local copy, the same remote
    for node in ("cache_latents", "cache_text", "train", "sample"):
        assert second["nodes"][node]["computed"] == 0, node
        assert second["nodes"][node]["status"] == "cached", node
    assert second["nodes"]["cache_text"]["changed"] == []  # the run record came from the remote
    lora = lambda r: Path(r["artifacts"]["lora"]).read_bytes()  # noqa: E731
    assert lora(first) == lora(second)
    assert second["artifacts"]["samples"] and all(Path(p).is_file() for p in second["artifacts"]["samples"])


def test_plans_and_results_reach_another_machine_by_key(url, tmp_path):
    """A Dask worker or sweep member on another machine gets the plan's key from Prefect and reads the plan
    from the shared store; a tampered remote copy is refused (its content must match its key)."""
    from tasks.store import CorruptArtifact

    one = open_store(StoreConfig(root=url, cache_dir=str(tmp_path / "m1")))
    key = one.put_state("plans", {"items": [{"name": "a.png"}]})
    two = open_store(StoreConfig(root=url, cache_dir=str(tmp_path / "m2")))
    assert two.get_state("plans", key) == {"items": [{"name": "a.png"}]}

    other = one.put_state("results", {"items": {"a.png": "k"}})
    one.fs.pipe_file(f"{one.base.rstrip('/')}/flowstate/results/{other[:2]}/{other}.json", b'{"items":{}}')
    three = open_store(StoreConfig(root=url, cache_dir=str(tmp_path / "m3")))
    with pytest.raises(CorruptArtifact):
        three.get_state("results", other)
