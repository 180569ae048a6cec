"""train.num_processes=2: the train node under `accelerate launch`, two CPU processes in a gloo group,
against one process at the same global batch, for every family.

What is promised, and why (docs/training.md, "Several processes"): the two runs do the same maths in another order.
Each process runs half the batch (CPU kernels are not batch-invariant) and the gradients are summed across
processes, not within one matrix product. So each step's loss agrees to the rounding of a mean over the
batch's latents, growing with the steps taken (tests/tolerance.py `rounding`); the LoRA weights agree to
Adam's step bound only (`adam_drift`), since Adam divides each gradient by its own size and a
rounding-level difference in a near-zero gradient can flip that weight's step."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from families import Family, image_families
from tasks import cache_latents, cache_text, train, validate
from tasks.config import compose, resolve_paths
from tasks.store import Store
from tasks.train import my_share
from tolerance import approx, assert_losses_close, assert_within_adam_drift

STEPS = ["train.max_steps=8", "train.log_every=1", "train.batch_size=4", "sample.steps=2"]
TWO = ("train.max_steps=4", "train.batch_size=4", "train.log_every=1")


def _train(store_root, *extra) -> dict:
    cfg = resolve_paths(compose("train", [f"store.root={store_root}", *STEPS, *extra])[0])
    store = Store(store_root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return train.run(cfg, plan, store, latents["items"], texts["items"])


@pytest.mark.numerics
# FLUX.1 Kontext without control images trains FLUX.1's transformer as flux does: the same run, left out
@pytest.mark.parametrize("family", [f for f in image_families() if f != "flux_kontext"])
def test_two_processes_match_one_at_the_same_global_batch(family, tmp_path):
    fam = Family(family, tmp_path)
    _, one = fam.train(*TWO)
    _, two = fam.train(*TWO, "train.num_processes=2")
    assert two["computed"] == 1 and two["key"] != one["key"]  # its own LoRA, not the 1-process one reused
    assert [x["step"] for x in two["losses"]] == [1, 2, 3, 4]
    assert_losses_close([x["loss"] for x in two["losses"]], [x["loss"] for x in one["losses"]],
                        n=fam.loss_terms(one, batch=4), what=f"{family} 2 processes")
    a, b = load_file(one["lora"]), load_file(two["lora"])
    cfg = fam.cfg(*TWO)
    assert_within_adam_drift(b, a, lr=cfg.train.lr, steps=4, what=f"{family} 2 processes")
    # and training moved the weights (lora_B starts at zero; Adam's first step moves it by lr): the comparison
    # is not between two untouched initialisations
    assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) >= cfg.train.lr


def test_a_failing_process_fails_the_node_with_its_output(tmp_path):
    # A job the worker cannot run (its latents are not in the store): the error carries the workers' lines.
    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}", *STEPS, "train.num_processes=2"])[0])
    store = Store(tmp_path / "store")
    plan = validate.run(cfg, store)
    keys = {it["name"]: "0" * 64 for it in plan.items}
    from tasks.training.distributed import launch_training

    out = tmp_path / "job"
    out.mkdir()
    with pytest.raises(RuntimeError, match=r"train.num_processes=2: the training processes failed \(exit \d+\): tasks.store.CorruptArtifact: .*latents"):
        launch_training(cfg, plan, keys, keys, out, "t" * 64, None)


@pytest.mark.parametrize("positions,world", [(4, 2), (5, 2), (3, 4), (1, 2), (6, 3)])
def test_shares_cover_the_batch_once_with_weights_summing_to_one(positions, world):
    shares = [my_share(positions, r, world) for r in range(world)]
    covered = sorted(j for mine, w in shares if w for j in mine)
    assert covered == list(range(positions))
    assert sum(w for _, w in shares) == approx(1.0, n=world, dtype=torch.float64)  # world float64 fractions
    for mine, w in shares:
        assert w == len(mine) / positions or (w == 0 and mine == [0])


def test_item_draws_do_not_depend_on_the_batch_split():
    from tasks.train import item_generators

    whole = [torch.randn(3, generator=g) for g in item_generators(0, 5, 4)]
    again = [torch.randn(3, generator=g) for g in item_generators(0, 5, 4)]
    assert all(torch.equal(x, y) for x, y in zip(whole, again))
    assert not torch.equal(whole[0], whole[1])
    other_step = [torch.randn(3, generator=g) for g in item_generators(0, 6, 4)]
    assert not torch.equal(whole[0], other_step[0])
