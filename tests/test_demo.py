"""`make run`'s demo (experiment=demo) through the flow: the pretrained demo base learns a new shape, visibly.

The goals are issue 29's, on the generated world's own scorer (tasks/demo/score.py): the base alone draws the
new shape for at most 20 % of the concept prompts, the LoRA for at least 80 %, and still draws at least 80 % of
the world's other prompts right. They are properties of a deterministic run on the AVX2 kernels (same bytes
every time), not of the machine's speed."""
from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from tasks.learning import _CELL, _PER_ROW, prompts


def test_demo_teaches_the_base_a_new_shape(prefect_api, tmp_path):
    from flows.train import train_flow

    out = train_flow(config_name="train", overrides=["experiment=demo", f"store.root={tmp_path / 'store'}",
                                                     f"hydra.run.dir={tmp_path / 'run'}"])
    report = json.loads(Path(out["report"]).read_text())
    learning = report["learning"]
    assert set(learning) >= {"concept_before", "concept_after", "base_kept"}
    assert learning["concept_before"] <= 0.2, learning
    assert learning["concept_after"] >= 0.8, learning
    assert learning["base_kept"] >= 0.8, learning

    sheet = Image.open(report["artifacts"]["before_after"])
    concept, kept = prompts(_learning_defaults())
    rows = -(-(len(concept) + len(kept)) // _PER_ROW)  # each prompt: base | LoRA, _PER_ROW prompts a row
    assert sheet.width >= _PER_ROW * 2 * _CELL and sheet.height >= rows * _CELL
    assert Path(report["artifacts"]["before_after"]).parent == tmp_path / "run" / "samples"


def _learning_defaults() -> dict:
    from tasks.config import compose, resolve_paths

    return resolve_paths(compose("train", ["experiment=demo"])[0]).learning


def test_learning_is_off_without_a_scorer():
    from tasks.config import compose, resolve_paths

    assert resolve_paths(compose("train", [])[0]).learning.scorer is None
