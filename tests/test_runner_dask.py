"""runner=dask: the caching nodes' missing items as shards, Prefect tasks on a distributed.LocalCluster started
and stopped by the run. The store ends up with the same bytes (latents, texts, LoRA) as runner=local; the report
says which worker computed how many; a worker killed in the middle of a shard costs only the rest of that shard
(its finished items stay, nothing torn is read) and the run completes; a no-op re-run starts no cluster."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import FAST, REPO

N_IMAGES = 12


def _run(tmp_path, name, store, *extra) -> dict:
    from flows.train import train_flow

    data, prompts = tmp_path / "data", tmp_path / "prompts.txt"
    if not data.exists():
        shutil.copytree(REPO / "data" / "demo", data)
        shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)
    out = train_flow(config_name="train", overrides=[f"data.dir={data}", f"sample.prompts_file={prompts}",
                                                     f"store.root={store}", f"hydra.run.dir={tmp_path / name}",
                                                     *FAST, *extra])
    return json.loads(Path(out["report"]).read_text())


def _entries(store: Path, kind: str) -> dict[str, bytes]:
    return {m.parent.name: (m.parent / "data.safetensors").read_bytes()
            for m in (store / kind).glob("*/*/manifest.json")}


def test_dask_shards_store_what_local_stores_and_survive_a_killed_worker(prefect_api, tmp_path, monkeypatch):
    local = _run(tmp_path, "local", tmp_path / "store-local")

    marker = tmp_path / "killed"  # the first cache_latents shard kills its worker after storing 2 latents
    monkeypatch.setenv("LORAFLOW_FAULT_KILL_WORKER_AFTER", f"cache_latents:2:{marker}")
    dask = _run(tmp_path, "dask", tmp_path / "store-dask", "runner=dask", "runner.n_workers=2")
    assert marker.exists()  # the worker was killed mid-shard

    lat, txt = dask["nodes"]["cache_latents"], dask["nodes"]["cache_text"]
    assert lat["computed"] == N_IMAGES and txt["computed"] == local["nodes"]["cache_text"]["computed"]
    assert all(w.startswith("tcp://") for w in [*lat["workers"], *txt["workers"]]), (lat, txt)
    # the killed shard's 2 stored latents were not computed again: the live workers computed the other 10
    assert sum(lat["workers"].values()) == N_IMAGES - 2, lat
    assert sum(txt["workers"].values()) == txt["computed"]
    assert local["nodes"]["cache_latents"]["workers"] == {"local": N_IMAGES}

    # the same bytes as runner=local: latents, texts, and so the LoRA
    for kind, n in (("latents", N_IMAGES), ("text", txt["computed"])):
        entries = _entries(tmp_path / "store-dask", kind)
        assert len(entries) == n and entries == _entries(tmp_path / "store-local", kind), kind
    assert Path(dask["artifacts"]["lora"]).read_bytes() == Path(local["artifacts"]["lora"]).read_bytes()

    again = _run(tmp_path, "again", tmp_path / "store-dask", "runner=dask", "runner.n_workers=2")
    assert again["nodes"]["cache_latents"]["computed"] == 0 and again["nodes"]["cache_latents"]["workers"] == {}
    assert again["nodes"]["train"]["status"] == "cached"
    log = (tmp_path / "again" / "loraflow.log").read_text()
    assert "runner:" not in log  # nothing missing: no cluster started
