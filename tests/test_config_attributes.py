"""Every setting the code reads exists in the schema: `cfg.train.lr`, `tc.max_steps` and the like are checked
against tasks/config_schema.py's dataclasses, so a misspelt setting fails here (and at type-check time), not
in the middle of a run on a path no test takes.

A short AST walk over tasks/, flows/ and bench/ (the names the code gives configs and their groups)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from tasks.config import ConfigError, as_plain, config_of, from_plain, updated
from tasks.config_schema import RootConfig

REPO = Path(__file__).resolve().parents[1]
GROUPS = {f.name: {g.name for g in dataclasses.fields(f.default_factory())} for f in dataclasses.fields(RootConfig)}
# the names a group is held under in the code -> the groups it can be
ALIASES = {"tc": ("train", "text"), "mc": ("model",), "dc": ("data",), "rc": ("runner",), "lcfg": ("learning",),
           "train_cfg": ("train",), "model_cfg": ("model",)}
CONFIGS = ("cfg",)  # the name that holds the whole config (attribute `.cfg` included)


def _name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _reads(path: Path):
    """(line, dotted setting) for each `cfg.<group>.<key>` and `<alias>.<key>` in one file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        inner = node.value
        if isinstance(inner, ast.Attribute) and _name(inner.value) in CONFIGS and inner.attr in GROUPS:
            yield node.lineno, inner.attr, node.attr
        elif isinstance(inner, ast.Name) and inner.id in ALIASES:
            yield node.lineno, ALIASES[inner.id], node.attr


def test_every_setting_read_is_in_the_schema():
    files = [p for package in ("tasks", "flows", "bench") for p in (REPO / package).rglob("*.py")
             if "third_party" not in p.parts]
    wrong, seen = [], 0
    for path in files:
        for line, groups, key in _reads(path):
            groups = (groups,) if isinstance(groups, str) else groups
            seen += 1
            if not any(key in GROUPS[g] for g in groups) and not key.startswith("__"):
                wrong.append(f"{path.relative_to(REPO)}:{line}: {'|'.join(groups)}.{key}")
    assert seen > 300, seen  # the walk finds the code's reads (about 400): it is not vacuous
    assert not wrong, "settings the schema does not have:\n" + "\n".join(wrong)


def test_a_misspelt_setting_in_code_is_caught(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(cfg, tc):\n    return cfg.train.learning_rate, tc.max_step, cfg.model.family\n")
    reads = list(_reads(bad))
    assert [(g if isinstance(g, str) else g[0], k) for _, g, k in reads] == [
        ("train", "learning_rate"), ("train", "max_step"), ("model", "family")]
    assert not any(k in GROUPS["train"] for _, _, k in reads[:2])


def test_plain_round_trip_and_unknown_keys():
    cfg = config_of({"train": {"rank": 16}, "model": {"family": "sd15"}})
    assert cfg.train.rank == 16 and cfg.model.family == "sd15" and cfg.train.lr == RootConfig().train.lr
    assert from_plain(as_plain(cfg)) == cfg  # what accelerate's workers and Prefect's parameters carry
    with pytest.raises(ConfigError, match="train.learning_rate is not a loraflow setting"):
        from_plain({**as_plain(cfg), "train": {**as_plain(cfg)["train"], "learning_rate": 1}})
    with pytest.raises(ConfigError, match="train.rnak is not a loraflow setting"):
        updated(cfg, {"train.rnak": 2})
    assert updated(cfg, {"train.rank": 2}).train.rank == 2 and cfg.train.rank == 16  # a copy
