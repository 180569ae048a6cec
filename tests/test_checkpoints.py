"""Checkpoints keyed by the training trajectory and step: raising train.max_steps continues from the
latest stored checkpoint, and the result is byte-identical to a straight run (CPU)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import REPO, Workspace


@pytest.fixture
def count_steps(monkeypatch):
    from tasks.models.flux import FluxAdapter

    calls = []
    original = FluxAdapter.training_loss

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FluxAdapter, "training_loss", counted)
    return calls


def _lora_bytes(report) -> bytes:
    return Path(report["artifacts"]["lora_files"]["diffusers"]).read_bytes()


def test_more_steps_continue_from_the_checkpoint(workspace, tmp_path, count_steps):
    short = workspace.run("train.max_steps=4")
    assert short["nodes"]["train"]["status"] == "ran" and "continued_from_step" not in short["nodes"]["train"]
    assert len(count_steps) == 4

    longer = workspace.run("train.max_steps=8")
    train = longer["nodes"]["train"]
    assert train["status"] == "ran" and train["continued_from_step"] == 4
    assert len(count_steps) == 8  # steps 5-8 only
    assert [e["step"] for e in longer["loss"]] == [4, 8]  # the curve covers all 8 steps (log_every=4)

    straight = Workspace(tmp_path / "straight")  # from an empty store
    shutil.copytree(workspace.data, straight.data)
    shutil.copyfile(workspace.prompts, straight.prompts)
    reference = straight.run("train.max_steps=8")
    assert "continued_from_step" not in reference["nodes"]["train"]
    assert _lora_bytes(longer) == _lora_bytes(reference)
    assert longer["loss"] == reference["loss"]


def test_a_schedule_that_depends_on_max_steps_starts_over(workspace, count_steps):
    workspace.run("train.max_steps=4", "train.lr_scheduler=linear")
    longer = workspace.run("train.max_steps=8", "train.lr_scheduler=linear")
    assert "continued_from_step" not in longer["nodes"]["train"] and len(count_steps) == 12


def test_save_every_n_steps_stores_checkpoints(workspace, count_steps):
    workspace.run("train.max_steps=6", "train.save_every_n_steps=2", "train.seed=7")
    from tasks.store import Store
    from tasks.train import CHECKPOINT_KIND

    stored = list((Store(workspace.store).root / CHECKPOINT_KIND).glob("*/*/manifest.json"))
    # baseline's final step 12 + steps 2, 4, 6 of this seed
    assert len(stored) == 4
    again = workspace.run("train.max_steps=5", "train.save_every_n_steps=2", "train.seed=7")
    assert again["nodes"]["train"]["continued_from_step"] == 4 and len(count_steps) == 7
    never = workspace.run("train.max_steps=5", "train.save_every_n_steps=2", "train.seed=7", "train.resume=never",
                          "train.lr=1e-3")
    assert "continued_from_step" not in never["nodes"]["train"] and len(count_steps) == 12


def test_the_fp16_loss_scaler_is_checkpointed(tmp_path):
    """fp16 training (loss scaling): a resumed run continues with the scale and growth tracker it had,
    not the initial scale (the scaler's state is JSON metadata of the checkpoint, no pickle)."""
    import torch

    from tasks.training.checkpoints import load_checkpoint, save_checkpoint
    from tasks.store import Store

    store = Store(tmp_path / "store")
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=7)
    scaler.scale(torch.ones(()))  # the scale exists once a loss was scaled
    scaler.update(new_scale=256.0)  # as after overflows
    scaler._growth_tracker.fill_(3)
    save_checkpoint(store, "k", 5, {"p": p}, opt, [0.5], {}, scaler)

    fresh = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=7)
    meta = load_checkpoint(store, "k", {"p": p}, opt, fresh)
    assert meta["loss_scaler"]["scale"] == 256.0
    assert fresh.get_scale() == 256.0 and fresh._get_growth_tracker() == 3
