"""The whole DAG: determinism, validation that stops everything, repair of corrupt items, the nodes as
plain functions without Prefect, and kohya prompt options reaching the sampler."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from tasks.store import Store
from tolerance import assert_close

REPO = Path(__file__).resolve().parents[1]


def test_two_empty_stores_give_byte_identical_loras(baseline, tmp_path):
    from conftest import Workspace

    other = Workspace(tmp_path / "fresh")
    shutil.copytree(baseline.data, other.data)
    shutil.copyfile(baseline.prompts, other.prompts)
    report = other.run()
    assert report["nodes"]["train"]["status"] == "ran"  # really trained again, from an empty store
    assert report["nodes"]["cache_latents"]["computed"] == 12
    mine = Path(report["artifacts"]["lora"]).read_bytes()
    theirs = Path(baseline.first_report["artifacts"]["lora"]).read_bytes()
    assert mine == theirs
    assert report["nodes"]["train"]["key"] == baseline.first_report["nodes"]["train"]["key"]


def test_demo_loss_goes_down(baseline):
    losses = [entry["loss"] for entry in baseline.first_report["loss"]]
    assert len(losses) >= 3 and losses[-1] < losses[0]


def test_outputs_are_real_files(baseline):
    art = baseline.first_report["artifacts"]
    from safetensors.torch import load_file

    lora = load_file(art["lora"])
    assert lora and all(".lora_A." in k or ".lora_B." in k for k in lora)
    assert len(art["samples"]) == 3
    for p in art["samples"] + [art["grid"]]:
        assert Image.open(p).size[0] > 0
    assert (Path(art["base_model"]) / "model_index.json").is_file()
    assert json.loads((Path(art["lora"]).parents[1] / "report.json").read_text())["artifacts"] == art


def test_validate_lists_every_bad_file_and_nothing_downstream_runs(prefect_api, tmp_path):
    from flows.train import train_flow
    from tasks.data.dataset import DatasetError

    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "demo", data)
    (data / "img_02.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")  # unreadable
    (data / "img_04.txt").unlink()  # image without caption
    store = tmp_path / "store"
    with pytest.raises(DatasetError) as e:
        train_flow("train", [f"data.dir={data}", f"store.root={store}", f"hydra.run.dir={tmp_path / 'run'}"])
    message = str(e.value)
    assert "img_02.png" in message and "img_04.png" in message
    assert "data.missing_caption=empty" in message
    assert not (store / "latents").exists() and not (store / "text").exists()
    assert not (tmp_path / "run" / "report.json").exists()


def test_missing_caption_policy_empty_trains(workspace):
    (workspace.data / "img_04.txt").unlink()
    r = workspace.run("data.missing_caption=empty")
    assert r["nodes"]["train"]["status"] == "ran"
    assert r["nodes"]["cache_text"]["changed"] == ["caption:img_04.png"]


def test_corrupt_items_are_detected_recomputed_and_reported(workspace):
    store = Store(workspace.store)
    latent = next((workspace.store / "latents").rglob("data.safetensors"))
    latent.write_bytes(latent.read_bytes()[:40])  # truncated
    text = next((workspace.store / "text").rglob("data.safetensors"))
    flipped = bytearray(text.read_bytes())
    flipped[-3] ^= 0x55
    text.write_bytes(bytes(flipped))
    r = workspace.run()
    assert r["nodes"]["cache_latents"]["computed"] == 1 and len(r["nodes"]["cache_latents"]["repaired"]) == 1
    assert r["nodes"]["cache_text"]["computed"] == 1 and len(r["nodes"]["cache_text"]["repaired"]) == 1
    # Same inputs, so same keys: the repaired items equal the originals and training stays cached.
    assert r["nodes"]["train"]["status"] == "cached"
    assert all(store.valid(kind, k) for kind in ("latents", "text")
               for k in [p.parent.name for p in (workspace.store / kind).rglob("manifest.json")])


def test_nodes_run_as_plain_functions_without_prefect(tmp_path):
    """Each node's core is a plain function; no Prefect API is needed to call them."""
    from tasks import cache_latents, cache_text, validate
    from tasks.config import compose, resolve_paths

    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}"])[0])
    store = Store(cfg.store.root)
    plan = validate.run(cfg, store)
    assert len(plan.items) == 12 and plan.size == [64, 64]
    first = cache_latents.run(cfg, plan, store)
    again = cache_latents.run(cfg, plan, store)
    assert (first["computed"], again["computed"], again["reused"]) == (12, 0, 12)
    assert first["key"] == again["key"] == cache_latents.key_of_node(cfg, plan)
    texts = cache_text.run(cfg, plan, store)
    embeds = store.get_tensors("text", texts["items"]["caption:img_00.png"])
    assert set(embeds) == {"prompt_embeds", "pooled_prompt_embeds", "attention_mask"}
    assert embeds["prompt_embeds"].shape[0] == cfg.model.max_sequence_length


def test_kohya_prompt_options_reach_the_sampler(workspace):
    workspace.prompts.write_text("a red circle --w 48 --h 32 --s 3 --l 2.5 --d 9 --n blurry\n"
                                 "a second prompt --x 1\n")
    r = workspace.run()
    assert r["nodes"]["sample"]["computed"] == 1
    assert any("line 2" in w or ":2:" in w for w in r["warnings"])  # the bad line is reported, not fatal
    image = Image.open(r["artifacts"]["samples"][0])
    assert image.size == (48, 32)
    meta = Store(workspace.store).meta("samples", _sample_key(workspace, "a red circle"))
    assert (meta["steps"], meta["guidance"], meta["seed"], meta["true_cfg"]) == (3, 2.5, 9, 2.0)


def _sample_key(ws, prompt: str) -> str:
    """The store key of the newest final sample of `prompt` (the store's own record of what it rendered)."""
    store = Store(ws.store)
    found = [m.parent for m in (ws.store / "samples").glob("*/*/manifest.json")
             if store.meta("samples", m.parent.name).get("prompt") == prompt and "step" not in store.meta("samples", m.parent.name)]
    return max(found, key=lambda d: d.stat().st_mtime).name


def test_lora_alpha_survives_into_the_loaded_pipeline(workspace):
    """alpha != rank: the published diffusers file has alpha/rank baked into lora_B (config alpha = r), so
    diffusers and ComfyUI (which ignores the config) apply the trained delta: the kohya file's alpha/rank * up@down."""
    from diffusers import FluxPipeline
    from safetensors import safe_open
    from safetensors.torch import load_file

    r = workspace.run("train.rank=4", "train.alpha=16")
    pipe = FluxPipeline.from_pretrained(r["artifacts"]["base_model"], use_safetensors=True)
    pipe.load_lora_weights(str(Path(r["artifacts"]["lora"]).parent))
    config = next(iter(pipe.transformer.peft_config.values()))
    assert (config.r, config.lora_alpha) == (4, 4)
    with safe_open(r["artifacts"]["lora"], "pt") as f:
        assert f.metadata()["loraflow_transformer.trained_alpha"] == "16.0"
    peft, kohya = load_file(r["artifacts"]["lora_files"]["diffusers"]), load_file(r["artifacts"]["lora_files"]["kohya"])
    m, k = "transformer.transformer_blocks.0.attn.to_out.0", "lora_unet_double_blocks_0_img_attn_proj"
    assert kohya[f"{k}.alpha"].item() == 16.0
    # a product over rank 4, and the scale: 2 roundings
    assert_close(peft[f"{m}.lora_B.weight"] @ peft[f"{m}.lora_A.weight"],
                 4.0 * kohya[f"{k}.lora_up.weight"] @ kohya[f"{k}.lora_down.weight"], n=4, stages=2, what=m)


def test_a_node_that_fails_raises_its_own_error(prefect_api, tmp_path, monkeypatch):
    """A node's unexpected error reaches the caller as itself: a KeyError in cache_latents was once read as "no
    stored result" and surfaced as a TypeError of the flow's bookkeeping."""
    from flows.train import train_flow
    from tasks import cache_latents

    def broken(*a, **k):
        raise KeyError("image")

    monkeypatch.setattr(cache_latents, "run", broken)
    with pytest.raises(KeyError, match="image"):
        train_flow("train", [f"data.dir={REPO / 'data' / 'demo'}", f"store.root={tmp_path / 'store'}",
                             f"hydra.run.dir={tmp_path / 'run'}"])
