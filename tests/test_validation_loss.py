"""Validation loss (issue 22, item 6): data.validation_split holds out a fixed, seeded set of images (cached,
never trained), scored every train.validate_every_n_steps at fixed draws; in the report, the checkpoints and
the sweep summary. validate_every_n_steps changes no weight and is not in the key."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tasks import cache_latents, cache_text, train, validate
from tasks.training import validation_loss as validation
from tasks.training.batches import Captions, Latents
from tasks.config import ConfigError, compose, resolve_paths
from tasks.store import Store
from tolerance import approx


def _cfg(*overrides):
    return resolve_paths(compose("train", ["train.log_with=none", *overrides])[0])


def _items(n, **extra):
    return [{"name": f"img_{i:02d}.png", **extra} for i in range(n)]


def test_the_split_is_seeded_deterministic_and_disjoint():
    items = _items(12)
    held = validation.held_out(items, 0.25)
    assert len(held) == 3 and held == validation.held_out(list(reversed(items)), 0.25)[::-1]  # by name, not order
    assert validation.held_out(items, 0.0) == []
    assert set(validation.held_out(items, 0.1)) <= set(held)  # a larger split holds out a superset
    # a flipped twin goes with its source; regularisation images are never held out
    flipped = items + [{"name": it["name"] + ":flipped", "flip_of": it["name"]} for it in items]
    assert set(validation.held_out(flipped, 0.25)) == set(held) | {n + ":flipped" for n in held}
    reg = _items(12) + [{"name": "reg.png", "is_reg": True}]
    assert "reg.png" not in validation.held_out(reg, 0.9)
    with pytest.raises(ConfigError, match="data.validation_split=0.5"):
        validation.held_out(_items(1), 0.5)  # at least one image must train


def test_config_errors_name_the_keys():
    assert validate.config_errors(_cfg("data.validation_split=0.2", "train.validate_every_n_steps=5")) == []
    assert any("data.validation_split=1.0" in e for e in validate.config_errors(_cfg("data.validation_split=1.0")))
    assert any("train.validate_every_n_steps=5 needs held-out images" in e
               for e in validate.config_errors(_cfg("train.validate_every_n_steps=5")))


def _plan(store_root, *overrides):
    cfg = _cfg(f"store.root={store_root}", "train.batch_size=2", *overrides)
    store = Store(store_root)
    plan = validate.run(cfg, store)
    return cfg, plan, store, cache_latents.run(cfg, plan, store)["items"], cache_text.run(cfg, plan, store)["items"]


def test_keys_held_out_items_cached_not_drawn(tmp_path):
    cfg0, plan0, _, lat0, txt0 = _plan(tmp_path / "s")
    cfg, plan, _, lat, txt = _plan(tmp_path / "s", "data.validation_split=0.25")
    held = plan.validation_items
    assert "validation_items" not in plan0.stored() and len(held) == 3  # the stored plan as it was
    assert set(lat) == {it["name"] for it in plan.items} == set(lat0) and lat == lat0  # all cached, same keys
    off, on = train.inputs(cfg0, plan0, lat0, txt0), train.inputs(cfg, plan, lat, txt)
    assert "validation" not in off and not any("validat" in k for k in off)  # the defaults: keys as they were
    assert train.key_of(off) != train.key_of(on) and set(on["validation"]["items"]) == set(held)
    assert not any(k == f"item:{n}" for n in held for k in on)  # held-out items are not trained pairs
    cfg_every = _cfg(f"store.root={tmp_path / 's'}", "train.batch_size=2", "data.validation_split=0.25",
                     "train.validate_every_n_steps=3")
    assert train.key_of(train.inputs(cfg_every, plan, lat, txt)) == train.key_of(on)  # changes no weight
    # batch_at never draws a held-out item
    repeats = [0 if it["name"] in held else 1 for it in plan.items]
    groups = train.buckets_of([(4, 8, 8)] * len(plan.items), repeats)
    drawn = {plan.items[i]["name"] for step in range(1, 13) for i in train.batch_at(step, groups, 2, 0)}
    assert drawn == {it["name"] for it in plan.items} - set(held)


def _train(store_root, *overrides) -> dict:
    cfg, plan, store, lat, txt = _plan(store_root, "data.validation_split=0.25", *overrides)
    out = train.run(cfg, plan, store, lat, txt)
    return {**out, "bytes": Path(out["lora"]).read_bytes()}


def test_validation_loss_curve_resume_and_no_effect_on_training(tmp_path):
    # trained to step 2, then raised to 4 (continued from the step-2 checkpoint): the whole curve
    short = _train(tmp_path / "a", "train.max_steps=2")
    assert [v["step"] for v in short["validation_loss"]] == [2]
    resumed = _train(tmp_path / "a", "train.max_steps=4", "train.validate_every_n_steps=1")
    assert resumed["continued_from_step"] == 2
    assert [v["step"] for v in resumed["validation_loss"]] == [2, 3, 4]
    assert resumed["validation_loss"][0] == short["validation_loss"][0]
    # a straight run gives the same curve (fixed draws; checkpoints carry it) and the same LoRA
    straight = _train(tmp_path / "b", "train.max_steps=4", "train.validate_every_n_steps=2")
    assert straight["continued_from_step"] is None and straight["bytes"] == resumed["bytes"]
    assert straight["validation_loss"] == [resumed["validation_loss"][0], resumed["validation_loss"][2]]
    # validating changes no weight: the LoRA bytes equal those of a run validating at the last step only
    last_only = _train(tmp_path / "c", "train.max_steps=4")
    assert last_only["bytes"] == straight["bytes"] and last_only["validation_loss"] == straight["validation_loss"][-1:]
    # a cached train node reports the curve stored with the LoRA
    again = _train(tmp_path / "b", "train.max_steps=4", "train.validate_every_n_steps=2")
    assert again["reused"] == 1 and again["validation_loss"] == straight["validation_loss"]
    assert all(v["loss"] > 0 for v in straight["validation_loss"])
    # without a split, nothing is reported and training draws every image
    cfg, plan, store, lat, txt = _plan(tmp_path / "c", "train.max_steps=1")
    assert train.run(cfg, plan, store, lat, txt)["validation_loss"] == []


def test_sweep_summary_shows_the_final_validation_loss(tmp_path):
    from omegaconf import OmegaConf

    from flows.sweep import SweepSummary

    sweep = tmp_path / "sweep"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": ["train.lr=1e-4,1e-3"]}}})
    callback = SweepSummary()
    callback.on_multirun_start(config)
    for n, val in (("0", [{"step": 2, "loss": 0.9}, {"step": 4, "loss": 0.25}]), ("1", [])):
        (sweep / n / ".hydra").mkdir(parents=True)
        OmegaConf.save(OmegaConf.create([f"train.lr={n}"]), sweep / n / ".hydra" / "overrides.yaml")
        report = {"nodes": {}, "artifacts": {}, "loss": [{"step": 4, "loss": 0.5}], "validation_loss": val}
        (sweep / n / "report.json").write_text(json.dumps(report))
    callback.on_multirun_end(config)
    summary = json.loads((sweep / "summary.json").read_text())
    assert [m["final_validation_loss"] for m in summary["members"]] == [0.25, None]
    md = (sweep / "summary.md").read_text()
    assert "| validation loss |" in md and "| 0.5000 | 0.2500 |" in md and "| 0.5000 | - |" in md


def test_the_flow_reports_and_logs_the_validation_loss(workspace):
    """Through the flow: report.json's validation_loss, TensorBoard's scalar; [] when off."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert workspace.run("train.max_steps=2")["validation_loss"] == []
    report = workspace.run("train.max_steps=4", "data.validation_split=0.25", "train.validate_every_n_steps=2")
    assert report["nodes"]["train"]["status"] == "ran"
    assert report["nodes"]["cache_latents"]["computed"] == 0  # the held-out images were cached already
    assert [v["step"] for v in report["validation_loss"]] == [2, 4]
    events = EventAccumulator(str(next(Path(report["artifacts"]["tensorboard"]).rglob("events.out.tfevents.*")).parent))
    events.Reload()
    # TensorBoard stores each value as a float32: one rounding (n=1)
    assert [(e.step, approx(e.value, n=1)) for e in events.Scalars("validation_loss")] == [
        (v["step"], v["loss"]) for v in report["validation_loss"]]


def test_the_reported_value_is_a_recomputation_on_the_trained_weights(tmp_path):
    """The last validation loss equals validation.score on the final checkpoint's LoRA weights."""
    from tasks.training.checkpoints import KIND, checkpoint_key
    from tasks.models import make_adapter
    from tasks.training.train_setup import make_accelerator, precision, prepare_denoiser

    cfg, plan, store, lat, txt = _plan(tmp_path / "s", "data.validation_split=0.25", "train.max_steps=3")
    out = train.run(cfg, plan, store, lat, txt)
    adapter = make_adapter(cfg.model, plan.model_dir)
    denoiser, named = prepare_denoiser(adapter, cfg)
    trajectory = train.trajectory_key(train.inputs(cfg, plan, lat, txt), cfg.train)
    stored = store.get_tensors(KIND, checkpoint_key(trajectory, 3))
    for name, p in named.items():
        p.data.copy_(stored[f"lora/{name}"])
    denoiser.train()  # as in the training loop
    held = plan.validation_items
    texts = Captions(cfg, dataclasses.replace(plan, items=[it for n in held for it in plan.items if it["name"] == n]),
                            store, adapter, txt)
    value = validation.score(adapter, denoiser, make_accelerator(precision(cfg)), held,
                             Latents(store, [lat[n] for n in held]), texts, cfg.train,
                             adapter.load_train_scheduler())
    assert out["validation_loss"] == [{"step": 3, "loss": value}]  # the same scoring on the same weights
    assert denoiser.training  # put back in train mode
