"""Issue 31, item 5: masked loss (`data.mask_dir`, `data.alpha_mask`) for every family.

- The loss: masked-out pixels give exactly zero gradient, masked-in ones their full one (sd-scripts'
  apply_masked_loss: mask on the latent grid by area average, times the per-element loss, mean over all).
- The mask lies on the pixels the latent was made from (the image's own resize and crop).
- Cached per item by content: a mask edit computes that mask alone (no latent, no text), then trains.
- Bad masks: missing, unreadable or of another size are named (data.bad_files=error) or left out (skip).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.models.bases.losses import BatchTrainConfig
from tasks.config_schema import TrainConfig
from tasks import cache_latents, cache_text, train, validate
from tasks.config import ConfigError, compose, resolve_paths
from tasks.data import masks
from tasks.data.images import image_to_tensor_and_geometry
from tasks.models.bases.losses import ddpm_loss, flow_loss
from tasks.store import Store

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["flux", "flux_kontext", "sd3", "sdxl", "sd15", "zimage", "qwenimage", "flux2_klein", "flux2_dev"]


def _half_mask(b=2, h=8, w=8):
    m = torch.zeros(b, 1, h, w)
    m[..., : w // 2] = 1.0
    return m


@pytest.mark.parametrize("loss", ["l2", "huber"])
def test_masked_out_elements_give_no_gradient(loss):
    gen = torch.Generator().manual_seed(0)
    pred = torch.randn(2, 4, 8, 8, generator=gen, requires_grad=True)
    target = torch.randn(2, 4, 8, 8, generator=gen)
    cfg = BatchTrainConfig(loss=loss, huber_c=0.1, loss_mask=_half_mask())
    for value in (flow_loss(pred, target, torch.ones(2, 1, 1, 1), cfg),
                  ddpm_loss(pred, target, cfg, scheduler=None, timesteps=None)):
        (grad,) = torch.autograd.grad(value, pred)
        assert torch.count_nonzero(grad[..., 4:]) == 0  # exactly: the loss there is multiplied by 0.0
        assert torch.count_nonzero(grad[..., :4]) == grad[..., :4].numel()


def test_mask_of_ones_is_the_unmasked_loss():
    gen = torch.Generator().manual_seed(1)
    pred, target = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 4, 8, 8, generator=gen)
    ones = BatchTrainConfig(loss="l2", loss_mask=torch.ones(2, 1, 8, 8))
    # x * 1.0 is exact, so both are the same sum of the same squares; only mse_loss's summation order may differ
    a, b = ddpm_loss(pred, target, ones, None, None), ddpm_loss(pred, target, TrainConfig(loss="l2"), None, None)
    assert abs(a.item() - b.item()) <= 256 * torch.finfo(torch.float32).eps * b.item()


def test_mask_goes_through_the_images_resize_and_crop():
    """A mask equal to the image's red channel comes out equal to the cropped image's red channel: the same
    resize (bicubic, per band) and the same crop."""
    img = Image.open(REPO / "data" / "demo" / "img_00.png").convert("RGB").resize((80, 52))
    red = img.getchannel("R")
    for w, h in ((32, 32), (48, 32), (32, 48)):
        pixels, _ = image_to_tensor_and_geometry(img, w, h)
        want = ((pixels[0] + 1) * 127.5).round()
        got = masks.mask_pixels(red, w, h)[0].float()
        assert got.shape == want.shape and (got - want).abs().max() <= 1  # uint8 vs float: one level at most
    flipped = masks.mask_pixels(red, 32, 32, flip=True)
    assert torch.equal(flipped, masks.mask_pixels(red.transpose(Image.Transpose.FLIP_LEFT_RIGHT), 32, 32))


def test_latent_grid_is_the_area_average():
    m = torch.zeros(1, 1, 16, 16, dtype=torch.uint8)
    m[..., :8, :] = 255
    grid = masks.on_latent_grid(m, (2, 2))
    assert grid.flatten().tolist() == [1.0, 1.0, 0.0, 0.0]


# -- through the nodes ----------------------------------------------------------------------------------------


def _dataset(root: Path, n: int = 4) -> Path:
    data = root / "data"
    data.mkdir(parents=True)
    for i in range(n):
        for ext in (".png", ".txt"):
            shutil.copyfile(REPO / "data" / "demo" / f"img_{i:02d}{ext}", data / f"img_{i:02d}{ext}")
    return data


def _masks(root: Path, data: Path) -> Path:
    mdir = root / "masks"
    mdir.mkdir()
    for i, img in enumerate(sorted(data.glob("*.png"))):
        w, h = Image.open(img).size
        m = np.zeros((h, w), np.uint8)
        m[:, : w // 2] = 255  # the left half trains
        m[i, -1] = 255  # and one pixel per image: distinct masks (identical ones are one store entry)
        Image.fromarray(m, "L").save(mdir / img.name)
    return mdir


def _cfg(root, *extra):
    return resolve_paths(compose("train", [f"store.root={root / 'store'}", "data.resolution=32", "train.max_steps=2",
                                           "train.batch_size=2", "train.log_with=none", *extra])[0])


def _nodes(cfg, store):
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return plan, lat, txt, train.run(cfg, plan, store, lat["items"], txt["items"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_with_masks_and_a_mask_edit_recomputes_that_mask(family, tmp_path):
    data = _dataset(tmp_path)
    mdir = _masks(tmp_path, data)
    store = Store(tmp_path / "store")
    base = [f"model=tiny_{family}", f"data.dir={data}"]
    plan, lat, txt, lora = _nodes(_cfg(tmp_path, *base, f"data.mask_dir={mdir}"), store)
    assert all(it["mask_kind"] == "file" for it in plan.items)
    assert lat["computed"] == 8 and sum(k.startswith(masks.PREFIX) for k in lat["items"]) == 4
    stored = store.get_tensors(cache_latents.KIND, lat["items"][masks.PREFIX + "img_00.png"])["mask"]
    assert stored.dtype == torch.uint8 and stored.shape == (1, 32, 32) and stored[..., :14].min() == 255  # bicubic: the edge column blends
    assert all(np.isfinite(e["loss"]) for e in lora["losses"])

    m = np.asarray(Image.open(mdir / "img_01.png")).copy()
    m[:4] = 255  # one mask edited
    Image.fromarray(m, "L").save(mdir / "img_01.png")
    _, lat2, txt2, lora2 = _nodes(_cfg(tmp_path, *base, f"data.mask_dir={mdir}"), store)
    assert (lat2["computed"], txt2["computed"]) == (1, 0)  # that mask alone: no latent, no text
    assert lora2["key"] != lora["key"] and lora2["computed"] == 1

    _, lat3, _, lora3 = _nodes(_cfg(tmp_path, *base), store)  # masks off: the unmasked run's keys
    assert lat3["computed"] == 0 and not any(k.startswith(masks.PREFIX) for k in lat3["items"])
    assert lora3["key"] not in (lora["key"], lora2["key"])


def test_alpha_mask(tmp_path):
    data = _dataset(tmp_path, 2)
    rgba = Image.open(data / "img_00.png").convert("RGBA")
    alpha = np.zeros(rgba.size[::-1], np.uint8)
    alpha[:, : rgba.size[0] // 2] = 255
    rgba.putalpha(Image.fromarray(alpha, "L"))
    rgba.save(data / "img_00.png")
    store = Store(tmp_path / "store")
    plan, lat, _, lora = _nodes(_cfg(tmp_path, "model=tiny_sd15", f"data.dir={data}", "data.alpha_mask=true"), store)
    got = {n: store.get_tensors(cache_latents.KIND, lat["items"][masks.PREFIX + n])["mask"] for n in
           ("img_00.png", "img_01.png")}
    assert got["img_00.png"][..., :15].min() == 255 and got["img_00.png"][..., 17:].max() == 0
    assert got["img_01.png"].min() == 255  # no alpha channel: trained everywhere, as sd-scripts
    assert all(np.isfinite(e["loss"]) for e in lora["losses"])


def test_bad_masks_are_named_or_left_out(tmp_path):
    data = _dataset(tmp_path)
    mdir = _masks(tmp_path, data)
    (mdir / "img_01.png").unlink()
    Image.new("L", (10, 10), 255).save(mdir / "img_02.png")
    (mdir / "img_03.png").write_bytes(b"not an image")
    store = Store(tmp_path / "store")
    with pytest.raises(ConfigError) as err:
        validate.run(_cfg(tmp_path, f"data.dir={data}", f"data.mask_dir={mdir}"), store)
    text = str(err.value)
    assert "3 image(s)" in text and "img_01.png: no mask img_01" in text and "data.bad_files=skip" in text
    assert "img_02.png: mask img_02.png is 10x10" in text and "img_03.png: cannot decode the mask" in text
    plan = validate.run(_cfg(tmp_path, f"data.dir={data}", f"data.mask_dir={mdir}", "data.bad_files=skip"), store)
    assert [it["name"] for it in plan.items] == ["img_00.png"]
    assert {f["file"] for f in plan.dataset if f["policy"] == "skipped"} >= {"img_01.png", "img_02.png", "img_03.png"}
    with pytest.raises(ConfigError, match="data.mask_dir=.*no such folder"):
        validate.run(_cfg(tmp_path, f"data.dir={data}", f"data.mask_dir={tmp_path / 'nope'}"), store)
    with pytest.raises(ConfigError, match="one mask per image"):
        validate.run(_cfg(tmp_path, f"data.dir={data}", f"data.mask_dir={mdir}", "data.alpha_mask=true"), store)
