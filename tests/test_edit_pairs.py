"""Issue 31: edit pairs (`data.control_dirs`) and control images of sample prompts (`--i`), on FLUX.1 Kontext
(`model=tiny_flux_kontext`) and FLUX.2's reference images ([klein], [dev]), at the node functions (4 demo images
at 32 px; no Prefect).

- Control images pair with targets by stem; a missing or unreadable one is named, or left out (bad_files=skip).
- Cached per item by content: a control image's latent is a `cache_latents` item like a target's. Edit matrix
  rows (contract.md): one control image's bytes -> cache_latents 1, cache_text 0, train ran, sample all; a
  control dir added -> only the control latents computed.
- Kontext and FLUX.2 train with the controls' tokens beside the target's (each control changes the loss; FLUX.2
  takes several), and sample with
  `--i` images (the saved sample shows the control beside the result; the key follows the control's bytes).
- The LoRA files load in `FluxKontextPipeline.load_lora_weights` and change its output.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tasks import cache_latents, cache_text, publish, sample, train, validate
from tasks.config import ConfigError, compose, resolve_paths
from tasks.data import controls
from tasks.data.prompts import PromptLineError, parse_prompt_line
from tasks.models import make_adapter
from tasks.store import Store
from support import run_nodes  # noqa: F401 (shared helpers, tests/support.py)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pairs(tmp_path):
    data, ctrl = tmp_path / "data", tmp_path / "ctrl"
    data.mkdir()
    ctrl.mkdir()
    for i in range(4):
        for ext in (".png", ".txt"):
            shutil.copyfile(REPO / "data" / "demo" / f"img_{i:02d}{ext}", data / f"img_{i:02d}{ext}")
        ImageOps.invert(Image.open(data / f"img_{i:02d}.png").convert("RGB")).save(ctrl / f"img_{i:02d}.png")
    (tmp_path / "prompts.txt").write_text("a red circle on a blue background --i ctrl/img_00.png\nplain prompt\n")
    return tmp_path


EDIT = ["tiny_flux_kontext", "tiny_flux2_klein", "tiny_flux2_dev"]


def _cfg(root, *extra, model="tiny_flux_kontext"):
    return resolve_paths(compose("train", [
        f"model={model}", f"data.dir={root / 'data'}", f"store.root={root / 'store'}", "data.resolution=32",
        f"sample.prompts_file={root / 'prompts.txt'}", "train.max_steps=2", "train.batch_size=2",
        "train.log_with=none", "sample.steps=2", *extra])[0])




def test_prompt_option_i_repeats():
    p = parse_prompt_line("x --i a.png --w 64 --i b.png", 3)
    assert p.images == ("a.png", "b.png") and p.width == 64
    assert parse_prompt_line("x", 1).images == ()
    with pytest.raises(PromptLineError, match="--i needs an image path"):
        parse_prompt_line("x --i", 1)


@pytest.mark.parametrize("model", EDIT[:2])
def test_edit_matrix_rows_and_samples(pairs, model):
    store = Store(pairs / "store")
    ctrl = f"data.control_dirs=[{pairs / 'ctrl'}]"
    # FLUX.2's pipeline takes references of 64 px a side or more: its samples at 64 px
    size = ["sample.width=64", "sample.height=64"] if "flux2" in model else []
    cfg = lambda *extra: _cfg(pairs, *size, *extra, model=model)  # noqa: E731
    # no control dir yet: plain text-to-image training (Kontext's example's other mode; FLUX.2 without refs)
    _, _, _, lora0, _ = run_nodes(cfg(), store)
    plan, lat, txt, lora, smp = run_nodes(cfg(ctrl), store)
    assert [len(it["controls"]) for it in plan.items] == [1, 1, 1, 1]
    assert (lat["computed"], txt["computed"]) == (4, 0)  # a control dir added: its latents only
    assert lora["key"] != lora0["key"]
    edited = np.asarray(Image.open(smp["samples"][0]))
    assert edited.shape[1] == 2 * edited.shape[0]  # the control image beside the result

    im = Image.open(pairs / "ctrl" / "img_02.png")
    im.putpixel((0, 0), (1, 2, 3))
    im.save(pairs / "ctrl" / "img_02.png")  # one control image's bytes
    _, lat2, txt2, lora2, smp2 = run_nodes(cfg(ctrl), store)
    assert (lat2["computed"], txt2["computed"], lora2["computed"]) == (1, 0, 1) and lora2["key"] != lora["key"]
    assert smp2["computed"] == 2  # sample: all (a new LoRA)

    im = Image.open(pairs / "ctrl" / "img_00.png")  # the --i image of prompt 1 (also a pair's control)
    im.putpixel((0, 0), (9, 9, 9))
    im.save(pairs / "ctrl" / "img_00.png")
    plan3 = validate.run(cfg(ctrl), store)
    keys2 = sample.item_keys(cfg(ctrl), plan3, lora2["key"], txt2["items"])
    before = sample.item_keys(cfg(ctrl), plan, lora2["key"], txt2["items"])
    assert keys2["prompt:1"] != before["prompt:1"] and keys2["prompt:2"] == before["prompt:2"]


@pytest.mark.parametrize("model", EDIT)
def test_control_changes_the_loss(pairs, model):
    store = Store(pairs / "store")
    cfg = _cfg(pairs, f"data.control_dirs=[{pairs / 'ctrl'}]", "sample.width=64", "sample.height=64", model=model)
    plan = validate.run(cfg, store)
    lat = cache_latents.run(cfg, plan, store)
    txt = cache_text.run(cfg, plan, store)
    adapter = make_adapter(cfg.model, plan.model_dir)
    den = adapter.load_denoiser()
    target = store.get_tensors(cache_latents.KIND, lat["items"]["img_00.png"])["latents"][None]
    control = store.get_tensors(cache_latents.KIND, lat["items"][controls.item_name("img_00.png", 0)])["latents"]
    name = cache_text.caption_name("img_00.png", next(iter(cache_text.caption_texts_of(cfg)(plan.items[0]))))
    text = {k: v[None] for k, v in store.get_tensors(cache_text.KIND, txt["items"][name]).items()}
    scheduler = adapter.load_train_scheduler()

    def loss(extra):
        gens = [torch.Generator().manual_seed(0)]
        return adapter.training_loss(den, target, {**text, **extra}, cfg.train, scheduler, gens).item()

    with torch.no_grad():
        plain, with_control = loss({}), loss({"control_latents": control[None, None]})
        inverted = loss({"control_latents": -control[None, None]})
        if model != "tiny_flux_kontext":  # FLUX.2: a second reference counts too
            two = loss({"control_latents": torch.stack([control, -control])[None]})
            assert two not in (with_control, inverted)
    assert plain != with_control and with_control != inverted


def test_bad_pairs_and_refusals(pairs):
    store = Store(pairs / "store")
    (pairs / "ctrl" / "img_01.png").unlink()
    (pairs / "ctrl" / "img_02.png").write_bytes(b"broken")
    ctrl = f"data.control_dirs=[{pairs / 'ctrl'}]"
    with pytest.raises(ConfigError) as err:
        validate.run(_cfg(pairs, ctrl), store)
    assert "2 image(s)" in str(err.value) and "img_01.png: no control image img_01" in str(err.value)
    assert "img_02.png: control image" in str(err.value) and "data.bad_files=skip" in str(err.value)
    plan = validate.run(_cfg(pairs, ctrl, "data.bad_files=skip"), store)
    assert [it["name"] for it in plan.items] == ["img_00.png", "img_03.png"]
    assert any("takes no control image" in e for e in validate.config_errors(_cfg(pairs, ctrl, model="tiny_flux")))
    with pytest.raises(ConfigError, match="--i gives a control image"):
        validate.run(_cfg(pairs, model="tiny_flux"), store)
    with pytest.raises(ConfigError, match=r"prompts.txt:1: --i: the control is fitted to the sample's 32x32, under the 64"):
        validate.run(_cfg(pairs, model="tiny_flux2_klein"), store)
    (pairs / "prompts.txt").write_text("x --i nope.png\n")
    with pytest.raises(ConfigError, match=r"prompts.txt:1: --i nope.png: no such file"):
        validate.run(_cfg(pairs), store)


def test_lora_files_load_in_the_kontext_pipeline(pairs):
    from diffusers import FluxKontextPipeline

    store = Store(pairs / "store")
    cfg = _cfg(pairs, f"data.control_dirs=[{pairs / 'ctrl'}]", "train.lr=0.05")
    plan, lat, txt, lora, _ = run_nodes(cfg, store)
    files = publish.publish(cfg, plan, store, pairs / "run", lora, [])["lora_files"]
    control = Image.open(pairs / "ctrl" / "img_00.png").convert("RGB").resize((32, 32))

    def render(file):
        pipe = FluxKontextPipeline.from_pretrained(plan.model_dir)
        if file:
            pipe.load_lora_weights(str(file))
        pipe.set_progress_bar_config(disable=True)
        return pipe(prompt="a red circle", image=control, _auto_resize=False, max_area=32 * 32, width=32,
                    height=32, num_inference_steps=2, max_sequence_length=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]

    # the kohya file is Flux's (BFL names, export._RULES["flux"]): diffusers' converter of it assumes FLUX.1's
    # widths, so at tiny width it is Flux's case (docs/lora-files.md), not read here
    assert np.abs(render(files["diffusers"]) - render(None)).max() > 0


def test_held_out_pairs_are_scored_with_their_controls(pairs, monkeypatch):
    """data.validation_split with edit pairs: a held-out pair's validation loss reads its control latents."""
    from tasks.training import validation_loss as validation

    seen = []
    score = validation.score

    def spy(*args, **kw):
        seen.append(args[-1] if len(args) > 8 else kw.get("controls"))
        return score(*args, **kw)
    monkeypatch.setattr(validation, "score", spy)
    store = Store(pairs / "store")
    cfg = _cfg(pairs, f"data.control_dirs=[{pairs / 'ctrl'}]", "data.validation_split=0.25")
    assert not validate.config_errors(cfg)
    _, _, _, lora, _ = run_nodes(cfg, store)
    assert seen and all(len(c) == 1 and len(c[0]) == 1 for c in seen)  # one held-out pair, one control each
    assert lora["validation_loss"] and all(np.isfinite(v["loss"]) for v in lora["validation_loss"])
