"""flows.explain: what a run would do, predicted without computing, then checked against a real run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import FAST, prefect_home

REPO = Path(__file__).resolve().parents[1]
N_IMAGES, N_PROMPTS = 12, 3
WORK = ("cache_latents", "cache_text", "train", "sample")


def _overrides(ws) -> list[str]:
    return [f"data.dir={ws.data}", f"sample.prompts_file={ws.prompts}", f"store.root={ws.store}", *FAST]


def test_explain_predicts_the_run(workspace):
    from flows.explain import explain

    # The workspace was trained once with these overrides: everything would come from the store.
    before = explain("train", _overrides(workspace))
    nodes = before["nodes"]
    assert before["previous_run"]
    assert list(nodes) == ["caption", "validate", *WORK]
    assert all(nodes[n]["would"] == "hit" and nodes[n]["compute"] == 0 for n in WORK), nodes
    assert all(e["changed"] == [] for e in nodes.values()), nodes
    assert nodes["cache_latents"]["reuse"] == N_IMAGES and nodes["sample"]["reuse"] == N_PROMPTS
    assert nodes["validate"]["compute"] == N_IMAGES  # validate always checks every image

    caption = workspace.data / "img_03.txt"
    caption.write_text(caption.read_text().strip() + ", edited\n")
    after = explain("train", _overrides(workspace))
    nodes = after["nodes"]
    assert nodes["cache_latents"]["would"] == "hit" and nodes["cache_latents"]["compute"] == 0
    assert nodes["cache_text"]["would"] == "run" and nodes["cache_text"]["compute"] == 1
    assert nodes["cache_text"]["changed"] == ["caption:img_03.png"]
    assert nodes["train"]["would"] == "run" and nodes["train"]["compute"] == 1
    assert "item:img_03.png" in nodes["train"]["changed"]
    assert "image or caption img_03.png" in nodes["train"]["changed_readable"]  # the run's log's words
    assert nodes["cache_text"]["changed_readable"] == ["caption img_03.txt"]
    assert nodes["sample"]["would"] == "run" and nodes["sample"]["compute"] == N_PROMPTS
    assert nodes["validate"]["changed"] == []  # captions are not validate's inputs, images are

    # Nothing was computed by explaining: the store still lacks the new caption's item.
    assert explain("train", _overrides(workspace))["nodes"]["cache_text"]["compute"] == 1

    report = workspace.run()
    for name, predicted in nodes.items():
        ran = report["nodes"][name]
        assert (ran["computed"], ran["reused"]) == (predicted["compute"], predicted["reuse"]), name
        assert ran["status"] == {"run": "ran", "hit": "cached"}[predicted["would"]], name
        assert ran["changed"] == predicted["changed"], name
    assert report["nodes"]["train"]["key"] == nodes["train"]["key"]

    again = explain("train", _overrides(workspace))["nodes"]
    assert all(again[n]["would"] == "hit" and again[n]["changed"] == [] for n in WORK), again


def _explain_cli(args, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": prefect_home(tmp_path / "prefect-home")}
    return subprocess.run([sys.executable, "-m", "flows.explain", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=300)


def test_explain_cli_table_and_user_errors(workspace, tmp_path):
    (workspace.prompts).write_text(workspace.prompts.read_text() + "a white star on a black background\n")
    proc = _explain_cli(_overrides(workspace), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for node in ("validate", *WORK):
        assert any(line.startswith(node + " ") for line in lines), proc.stdout
    row = next(line for line in lines if line.startswith("sample "))
    assert "run" in row and f"{workspace.prompts.name} line " in row  # one new prompt, named as a run names it
    assert "would compute in: cache_text, sample" in proc.stdout

    proc = _explain_cli([*_overrides(workspace), "train.lrr=1"], tmp_path)
    assert proc.returncode == 2
    assert "train.lrr" in proc.stderr
