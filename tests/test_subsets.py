"""Datasets (issue 22, item 1): data.subsets with repeats / caption extension / is_reg, kohya's N_name folders,
train.prior_loss_weight, data.flip_aug, data.random_crop refused; data.dir alone keeps its keys."""
from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from tasks.models.bases.losses import for_batch
from tasks.config_schema import TrainConfig
from tasks import cache_latents, cache_text, train, validate
from tasks.config import compose, resolve_paths
from tasks.models.bases.losses import ddpm_loss, flow_loss
from tasks.store import Store
from tolerance import approx

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo"
NEW = ("flip_aug", "random_crop", "subsets")
L2 = TrainConfig(loss="l2", huber_c=0.1, min_snr_gamma=None)


def _cfg(*overrides):
    return resolve_paths(compose("train", ["train.log_with=none", *overrides])[0])


def _copy(dst: Path, stems) -> Path:
    dst.mkdir(parents=True)
    for stem in stems:
        for ext in (".png", ".txt"):
            shutil.copyfile(DEMO / f"{stem}{ext}", dst / f"{stem}{ext}")
    return dst


def _kohya(root: Path) -> Path:
    _copy(root / "10_char", ["img_00", "img_01"])
    _copy(root / "1_style", ["img_02"])
    return root


def _plan(store_root, *overrides):
    cfg = _cfg(f"store.root={store_root}", *overrides)
    return cfg, validate.run(cfg, Store(store_root))


def _train(store_root, *overrides) -> dict:
    cfg, plan = _plan(store_root, "train.batch_size=2", "train.max_steps=2", *overrides)
    store = Store(store_root)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return train.run(cfg, plan, store, latents["items"], texts["items"])


def _epoch_counts(plan: dict, batch_size: int = 1) -> Counter:
    """How often each item is drawn over the first epoch of train's sampling order."""
    repeats = [it.get("repeats", 1) for it in plan.items]
    groups = train.buckets_of([(4, 8, 8)] * len(plan.items), repeats)
    per_epoch = -(-sum(repeats) // batch_size)
    drawn = [i for step in range(1, per_epoch + 1) for i in train.batch_at(step, groups, batch_size, 0)]
    return Counter(plan.items[i]["name"] for i in drawn)


def test_kohya_folders_are_subsets_with_their_repeats(tmp_path):
    _, plan = _plan(tmp_path / "store", f"data.dir={_kohya(tmp_path / 'data')}")
    assert plan.dataset_subsets == [
        {"folder": str(tmp_path / "data" / "10_char"), "images": 2, "repeats": 10, "is_reg": False},
        {"folder": str(tmp_path / "data" / "1_style"), "images": 1, "repeats": 1, "is_reg": False}]
    # names as relative to data.dir; repeats only where not 1
    assert [(it["name"], it.get("repeats")) for it in plan.items] == [
        ("10_char/img_00.png", 10), ("10_char/img_01.png", 10), ("1_style/img_02.png", None)]
    assert _epoch_counts(plan, batch_size=2) == {"10_char/img_00.png": 10, "10_char/img_01.png": 10,
                                                 "1_style/img_02.png": 1}


def test_a_linked_folder_beside_kohya_folders_is_named(tmp_path):
    root = _kohya(tmp_path / "data")
    (root / "5_linked").symlink_to(root / "1_style")
    _, plan = _plan(tmp_path / "store", f"data.dir={root}")
    assert [s["repeats"] for s in plan.dataset_subsets] == [10, 1]
    assert "data: linked folder 5_linked/ in data.dir is not followed (its images are not trained)" in plan.warnings


def test_mixed_layout_is_one_folder_with_a_warning(tmp_path):
    root = _kohya(tmp_path / "data")
    _copy(root / "extra", ["img_03"])  # images outside any N_name folder: not a kohya layout
    _, plan = _plan(tmp_path / "store", f"data.dir={root}")
    assert plan.dataset_subsets == [{"folder": str(root), "images": 4, "repeats": 1, "is_reg": False}]
    assert all("repeats" not in it for it in plan.items)
    assert any("kohya N_name folders (10_char, 1_style)" in w and "extra/" in w for w in plan.warnings)


def test_subsets_repeats_change_the_sampling_counts_and_the_key(tmp_path):
    a, b = _copy(tmp_path / "a", ["img_00", "img_01"]), _copy(tmp_path / "b", ["img_02"])
    (b / "img_02.caption").write_text("a caption from another extension")
    overrides = [f"data.subsets=[{{dir: {a}, repeats: 3}}, {{dir: {b}, caption_extension: .caption}}]"]
    cfg, plan = _plan(tmp_path / "store", *overrides)
    assert [it["name"] for it in plan.items] == ["a/img_00.png", "a/img_01.png", "b/img_02.png"]
    assert plan.items[2]["caption"] == "a caption from another extension"
    assert [s["repeats"] for s in plan.dataset_subsets] == [3, 1]
    assert _epoch_counts(plan) == {"a/img_00.png": 3, "a/img_01.png": 3, "b/img_02.png": 1}
    once = _plan(tmp_path / "store", f"data.subsets=[{{dir: {a}}}, {{dir: {b}, caption_extension: .caption}}]")
    assert _epoch_counts(once[1]) == {"a/img_00.png": 1, "a/img_01.png": 1, "b/img_02.png": 1}
    # repeats are in an item's pair of the train key; the latents are the images' (cached once)
    keys = [cache_latents.item_keys(c, p) for c, p in ((cfg, plan), once)]
    assert keys[0] == keys[1]
    inputs = [train.inputs(c, p, k, cache_text.item_keys(c, p)) for (c, p), k in zip(((cfg, plan), once), keys)]
    assert inputs[0]["item:a/img_00.png"] != inputs[1]["item:a/img_00.png"]
    assert inputs[0]["item:b/img_02.png"] == inputs[1]["item:b/img_02.png"]


def test_data_dir_alone_keeps_its_plan_and_train_key(tmp_path):
    cfg, plan = _plan(tmp_path / "store")
    assert plan.dataset_subsets == [{"folder": str(DEMO), "images": 12, "repeats": 1, "is_reg": False}]
    assert all(set(it) == {"name", "image", "image_digest", "caption"} for it in plan.items)  # as before
    lk, tk = cache_latents.item_keys(cfg, plan), cache_text.item_keys(cfg, plan)
    # at their defaults the settings added since are not in the key, so it is the key of before they existed
    inputs = train.inputs(cfg, plan, lk, tk)
    assert not [k for k in inputs for new in (*NEW, "prior_loss_weight") if k.split(".")[-1] == new]
    assert not {"train.prior_loss_weight"} & set(train.inputs(_cfg("train.prior_loss_weight=0.5"), plan, lk, tk))
    # one entry of data.subsets is data.dir: the same items, the same keys
    same = _plan(tmp_path / "store", f"data.subsets=[{{dir: {DEMO}}}]")[1]
    assert same.items == plan.items


def test_item_weights_on_a_known_input():
    pred, target = torch.tensor([[1.0, 1.0], [2.0, 2.0]]), torch.zeros(2, 2)  # per-item l2: 1 and 4
    ones = torch.ones(2, 1)
    assert flow_loss(pred, target, ones, L2).item() == 2.5
    assert flow_loss(pred, target, ones, for_batch(L2, [1.0, 0.5], None)).item() == (1 + 2) / 2
    assert ddpm_loss(pred, target, for_batch(L2, [0.0, 1.0], None), None, None).item() == 2.0


def test_reg_images_are_weighted_by_prior_loss_weight(tmp_path):
    reg = f"data.subsets=[{{dir: {DEMO}, is_reg: true}}]"
    zero = _train(tmp_path / "s", reg, "train.prior_loss_weight=0")
    assert [w["loss"] for w in zero["losses"]] == [0.0] * len(zero["losses"])  # only reg images, weight 0
    one = _train(tmp_path / "s", reg, "train.log_every=1")
    two = _train(tmp_path / "s", reg, "train.prior_loss_weight=2", "train.log_every=1")
    assert len({zero["key"], one["key"], two["key"]}) == 3
    # same draws: twice the loss, to the rounding of the weighted mean over the batch's latent values
    cfg, plan = _plan(tmp_path / "s", reg)
    shape = Store(tmp_path / "s").tensor_shapes(cache_latents.KIND, cache_latents.item_keys(cfg, plan)[plan.items[0]["name"]])
    assert two["losses"][0]["loss"] == approx(2 * one["losses"][0]["loss"], n=2 * math.prod(shape["latents"]))
    with pytest.raises(Exception):
        _cfg("train.prior_loss_weight=x")
    assert validate.config_errors(_cfg("train.prior_loss_weight=-1"))[0].startswith("train.prior_loss_weight=-1")


def test_flip_aug_caches_the_mirror_as_its_own_latent(tmp_path):
    store = tmp_path / "store"
    cfg, plan = _plan(store, "data.flip_aug=true")
    assert len(plan.items) == 24 and plan.items[12]["flip_of"] == plan.items[0]["name"]
    latents = cache_latents.run(cfg, plan, Store(store))
    assert latents["computed"] == 24
    assert cache_latents.run(cfg, plan, Store(store))["computed"] == 0
    z = [Store(store).get_tensors("latents", latents["items"][it["name"]])["latents"] for it in plan.items[::12]]
    assert not torch.equal(z[0], z[1])
    plain_cfg, plain = _plan(store)
    assert cache_text.run(plain_cfg, plain, Store(store))["computed"] > 0
    texts = cache_text.run(cfg, plan, Store(store))  # the text cache is that of the plain folder
    assert texts["computed"] == 0 and texts["key"] == cache_text.key_of_node(plain_cfg, plain)
    assert cache_latents.run(plain_cfg, plain, Store(store))["computed"] == 0  # the unflipped latents are shared


def test_edits_with_flip_aug(tmp_path):
    """The edit matrix with flips: one image edit re-encodes it and its mirror, one caption edit one text."""
    from PIL import Image

    data, store = _copy(tmp_path / "data", ["img_00", "img_01", "img_02"]), tmp_path / "store"

    def caches():
        cfg, plan = _plan(store, f"data.dir={data}", "data.flip_aug=true")
        return [node.run(cfg, plan, Store(store))["computed"] for node in (cache_latents, cache_text)]

    first = caches()
    assert first[0] == 6
    img = Image.open(data / "img_01.png").convert("RGB")
    img.putpixel((0, 0), (255, 0, 0))
    img.save(data / "img_01.png")
    (data / "img_02.txt").write_text("an edited caption")
    assert caches() == [2, 1]


def test_resume_is_exact_with_repeats_flips_and_reg_images(tmp_path):
    root = _kohya(tmp_path / "data")
    opts = (f"data.subsets=[{{dir: {root / '10_char'}, repeats: 3}}, {{dir: {root / '1_style'}, is_reg: true}}]",
            "data.flip_aug=true", "train.prior_loss_weight=0.5")
    straight = _train(tmp_path / "a", "train.max_steps=4", *opts)
    _train(tmp_path / "b", "train.max_steps=2", *opts)
    continued = _train(tmp_path / "b", "train.max_steps=4", *opts)
    assert continued["continued_from_step"] == 2 and continued["key"] == straight["key"]
    assert open(straight["lora"], "rb").read() == open(continued["lora"], "rb").read()


def test_refusals():
    errors = validate.config_errors(_cfg("data.random_crop=true", "data.subsets=[{dir: x, repeats: 0}]"))
    assert any(e.startswith("data.random_crop=true: latents are cached once per image") for e in errors)
    assert any(e.startswith("data.subsets[0].repeats=0") for e in errors)
    assert not validate.config_errors(_cfg("data=subsets_example"))


def test_report_lists_the_kohya_folders(prefect_api, tmp_path):
    """Through the flow: report.json's dataset_subsets, and the node counts (each image cached once)."""
    import json

    from flows.train import train_flow

    root = _kohya(tmp_path / "data")
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", tmp_path / "prompts.txt")
    out = train_flow(config_name="train", overrides=[
        f"data.dir={root}", f"sample.prompts_file={tmp_path / 'prompts.txt'}", f"store.root={tmp_path / 'store'}",
        f"hydra.run.dir={tmp_path / 'run'}", "train.max_steps=2", "sample.steps=1", "data.flip_aug=true"])
    report = json.loads(Path(out["report"]).read_text())
    assert report["dataset_subsets"] == [
        {"folder": str(root / "10_char"), "images": 2, "repeats": 10, "is_reg": False},
        {"folder": str(root / "1_style"), "images": 1, "repeats": 1, "is_reg": False}]
    assert report["nodes"]["validate"]["computed"] == 3  # images checked (the mirrors are not files)
    assert report["nodes"]["cache_latents"]["computed"] == 6  # 3 images and their mirrors
    assert report["nodes"]["train"]["status"] == "ran"
