"""Kills and concurrent writers (reliability campaign).

Each node is SIGKILLed in a real subprocess half-way through writing an item (its data written, never
committed), after some items are finished; the re-run completes, computes only what was not finished, and
every stored artifact is byte-identical to an uninterrupted run's in an empty store (CPU). One kill goes
through the real Hydra CLI. Then four processes fill one store with overlapping items at once.
(tests/test_kill.py and tests/test_resume.py keep their narrower cases: a torn latent write, a kill right
after a checkpoint.)"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import prefect_home
from faults import KILL_AT, OVERRIDES, REPO, child, debris, entries, pipeline, snapshot
from tasks.store.hashing import digest_file
from tasks.store import Store

_PIPELINE_CHILD = KILL_AT + "from faults import pipeline\npipeline(sys.argv[3], sys.argv[4:])\n"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run in an empty store: its results and every entry's bytes (as digests)."""
    root = tmp_path_factory.mktemp("reference") / "store"
    results = pipeline(root, OVERRIDES)
    return results, snapshot(root)


# (kind killed, entries of that kind finished before the kill, node that writes it)
KILLS = [("models", 0, "validate"), ("latents", 5, "cache_latents"), ("text", 3, "cache_text"),
         ("checkpoints", 2, "train"), ("lora", 0, "train"), ("samples", 1, "sample")]
_UPSTREAM = {"validate": [], "cache_latents": [], "cache_text": ["cache_latents"],
             "train": ["cache_latents", "cache_text"], "sample": ["cache_latents", "cache_text", "train"]}


@pytest.mark.parametrize("kind,done,node", KILLS, ids=[k[0] for k in KILLS])
def test_node_killed_mid_write_then_rerun(reference, tmp_path, kind, done, node):
    ref_results, ref_bytes = reference
    root = tmp_path / "store"
    proc = child(_PIPELINE_CHILD, kind, done, root, *OVERRIDES)
    assert proc.returncode == -9, proc.stderr[-3000:]
    killed = entries(root)
    assert sum(k.startswith(f"{kind}/") for k in killed) == done  # the torn item never became an entry
    assert all(Store(root).valid(*k.split("/")) for k in killed)

    rerun = pipeline(root, OVERRIDES)
    for up in _UPSTREAM[node]:
        assert rerun[up]["computed"] == 0, up  # nothing finished upstream is redone
    if kind == "checkpoints":  # steps 1..4 are not trained again
        assert rerun["train"]["continued_from_step"] == 2 * done and rerun["train"]["computed"] == 1
    elif kind == "lora":  # killed while storing the LoRA: the final checkpoint makes it a copy
        assert rerun["train"]["continued_from_step"] == 8
    elif node != "validate":  # (validate: the tiny model, built again whole)
        total = ref_results[node]["computed"]
        assert (rerun[node]["computed"], rerun[node]["reused"]) == (total - done, done)
    assert snapshot(root) == ref_bytes  # every latent, text, checkpoint, LoRA, sample: the same bytes
    assert rerun["train"]["losses"] == ref_results["train"]["losses"]


# The real CLI (Hydra app, Prefect flow with its own ephemeral API), killed storing the 3rd checkpoint.
_CLI_CHILD = KILL_AT + "import runpy\nsys.argv = ['flows.train', *sys.argv[3:]]\n" \
                       "runpy.run_module('flows.train', run_name='__main__', alter_sys=True)\n"


def _servers_of(home: str) -> list[int]:
    """Live uvicorn processes started with this PREFECT_HOME (Linux /proc)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"uvicorn" in (proc / "cmdline").read_bytes() and \
                    f"PREFECT_HOME={home}".encode() in (proc / "environ").read_bytes().split(b"\0") and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_cli_killed_mid_training_then_rerun(reference, prefect_api, tmp_path):
    from flows.train import train_flow

    _, ref_bytes = reference
    root = tmp_path / "store"
    env = {"PREFECT_HOME": prefect_home(tmp_path / "prefect-home"), "PREFECT_API_URL": None}  # its own ephemeral API
    proc = child(_CLI_CHILD, "checkpoints", 2, f"store.root={root}", f"hydra.run.dir={tmp_path / 'run1'}",
                 *OVERRIDES, env=env, timeout=400)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert not (tmp_path / "run1" / "report.json").exists()
    # its temporary Prefect server (in a session of its own, away from Ctrl-C) does not outlive it
    deadline = time.monotonic() + 20
    while _servers_of(env["PREFECT_HOME"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _servers_of(env["PREFECT_HOME"])

    out = train_flow(config_name="train", overrides=[f"store.root={root}", f"hydra.run.dir={tmp_path / 'run2'}",
                                                     *OVERRIDES])
    report = json.loads((tmp_path / "run2" / "report.json").read_text())
    nodes = report["nodes"]
    assert (nodes["cache_latents"]["computed"], nodes["cache_text"]["computed"]) == (0, 0)
    assert nodes["train"]["status"] == "ran" and nodes["train"]["continued_from_step"] == 4
    assert nodes["sample"]["computed"] == 3
    after = snapshot(root)
    # derived from the LoRA by publish, which the reference skips: the exports and the loss chart
    exports = ("lora_kohya/", "lora_diffusers/", "loss_chart/")
    assert {k: v for k, v in after.items() if not k.startswith(exports)} == ref_bytes
    lora = next(k for k in after if k.startswith("lora_diffusers/"))
    published = report["artifacts"]  # the run folder's copies: the same bytes as well
    assert digest_file(published["lora_files"]["diffusers"]) == after[lora]
    assert sorted(digest_file(p) for p in published["samples"]) == \
        sorted(v for k, v in ref_bytes.items() if k.startswith("samples/"))
    assert out["run_dir"] == str(tmp_path / "run2")


# A store filler: waits for the go file so the four really overlap, then validate + cache_latents + cache_text.
_FILL_CHILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, "tests")
from faults import pipeline
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.05)
pipeline(sys.argv[1], sys.argv[3:], stop_after="cache_text")
"""


def test_four_processes_fill_one_store(reference, tmp_path):
    _, ref_bytes = reference
    images = sorted((REPO / "data" / "demo").glob("*.png"))
    prompts = [line for line in (REPO / "data" / "demo_prompts.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    root, go, procs = tmp_path / "store", tmp_path / "go", []
    try:
        for i in range(4):  # each process: 3 of every 4 images, 2 of the 3 prompts (every item in 2-3 of them)
            data = tmp_path / f"data{i}"
            data.mkdir()
            for j, img in enumerate(images):
                if j % 4 != i:
                    shutil.copy(img, data)
                    shutil.copy(img.with_suffix(".txt"), data)
            pfile = tmp_path / f"prompts{i}.txt"
            pfile.write_text("\n".join(p for j, p in enumerate(prompts) if j != i % 3) + "\n")
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _FILL_CHILD, str(root), str(go), f"data.dir={data}",
                 f"sample.prompts_file={pfile}", *OVERRIDES], cwd=REPO, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"}))
        go.touch()
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]

    store = Store(root)
    stored = entries(root)
    assert all(store.valid(*name.split("/")) for name in stored)  # every item verifies
    assert debris(root) == []  # no temp folders left by the writers that lost a race
    kinds = ("models", "latents", "text")
    assert snapshot(root) == {k: v for k, v in ref_bytes.items() if k.split("/")[0] in kinds}
