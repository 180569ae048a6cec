"""contract.md's edit matrix: what a re-run after each kind of edit recomputes (report.json counts).

Each test copies the baseline workspace (demo data, prompts, store with the baseline run's record),
makes one edit, runs the whole flow through Prefect, and checks every node's counts."""
from __future__ import annotations

import shutil

import pytest
from PIL import Image

N_IMAGES, N_PROMPTS = 12, 3


def counts(report):
    n = report["nodes"]
    return (n["cache_latents"]["computed"], n["cache_text"]["computed"], n["train"]["status"],
            n["sample"]["computed"])


def distinct_texts(ws) -> int:
    from tasks.data.prompts import read_prompts

    texts = {p.read_text().strip() for p in ws.data.glob("*.txt")} | {""}
    for p in read_prompts(ws.prompts)[0]:
        texts |= {p.prompt, p.negative}
    return len(texts)


def test_baseline_computed_everything(baseline):
    r = baseline.first_report
    assert counts(r) == (N_IMAGES, distinct_texts(baseline), "ran", N_PROMPTS)
    assert set(r["nodes"]) == {"caption", "validate", "cache_latents", "cache_text", "train", "sample"}
    for entry in r["nodes"].values():
        assert set(entry) >= {"status", "key", "computed", "reused", "seconds", "changed"}
        assert entry["reused"] == 0 and entry["changed"] == []


def test_nothing_changed_same_store(baseline):
    # Same store: Prefect's own cache answers with loraflow's keys, and the store is verified.
    r = baseline.run()
    assert counts(r) == (0, 0, "cached", 0)
    assert all(e["status"] == "cached" for n, e in r["nodes"].items() if n != "validate")  # caption: off
    assert all(e["changed"] == [] for e in r["nodes"].values())


def test_nothing_changed_copied_store(workspace):
    # A copied store has another root, so Prefect's cache misses: loraflow's per-item store answers.
    r = workspace.run()
    assert counts(r) == (0, 0, "cached", 0)
    assert r["nodes"]["cache_latents"]["reused"] == N_IMAGES
    assert r["nodes"]["sample"]["reused"] == N_PROMPTS


def test_one_sample_prompt_edited(workspace):
    lines = workspace.prompts.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if "green square" in line)
    lines[i] = lines[i].replace("green square", "purple square")
    workspace.prompts.write_text("\n".join(lines) + "\n")
    r = workspace.run()
    assert counts(r) == (0, 1, "cached", 1)
    assert r["nodes"]["sample"]["reused"] == N_PROMPTS - 1
    assert r["nodes"]["cache_text"]["changed"] == [f"prompt:{i + 1}"]
    assert r["nodes"]["sample"]["changed"] == [f"prompt:{i + 1}"]


@pytest.mark.parametrize("override", ["sample.steps=3", "sample.cfg=2.0", "sample.seed=7"])
def test_sample_settings_changed(workspace, override):
    r = workspace.run(override)
    assert counts(r) == (0, 0, "cached", N_PROMPTS)


def test_one_caption_edited(workspace):
    (workspace.data / "img_03.txt").write_text("a completely new caption\n")
    r = workspace.run()
    assert counts(r) == (0, 1, "ran", N_PROMPTS)
    assert r["nodes"]["cache_text"]["changed"] == ["caption:img_03.png"]
    assert r["nodes"]["train"]["changed"] == ["item:img_03.png"]


def test_one_image_edited(workspace):
    path = workspace.data / "img_05.png"
    img = Image.open(path).convert("RGB")
    img.putpixel((0, 0), (0, 0, 0) if img.getpixel((0, 0)) != (0, 0, 0) else (255, 255, 255))
    img.save(path)
    r = workspace.run()
    assert counts(r) == (1, 0, "ran", N_PROMPTS)
    assert r["nodes"]["cache_latents"]["changed"] == ["image:img_05.png"]


def test_one_image_and_caption_added(workspace):
    shutil.copyfile(workspace.data / "img_00.png", workspace.data / "img_new.png")
    Image.open(workspace.data / "img_new.png").transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(
        workspace.data / "img_new.png")
    (workspace.data / "img_new.txt").write_text("a mirrored red circle\n")
    r = workspace.run()
    assert counts(r) == (1, 1, "ran", N_PROMPTS)
    assert r["nodes"]["cache_latents"]["reused"] == N_IMAGES


def test_one_image_removed(workspace):
    (workspace.data / "img_07.png").unlink()
    (workspace.data / "img_07.txt").unlink()
    r = workspace.run()
    assert counts(r) == (0, 0, "ran", N_PROMPTS)
    assert r["nodes"]["cache_latents"]["reused"] == N_IMAGES - 1


def test_resolution_changed(workspace):
    r = workspace.run("data.resolution=48")
    assert counts(r) == (N_IMAGES, 0, "ran", N_PROMPTS)


@pytest.mark.parametrize("override", ["train.lr=5e-3", "train.rank=2", "train.max_steps=10", "train.seed=1"])
def test_training_hyperparameter_changed(workspace, override):
    r = workspace.run(override)
    assert counts(r) == (0, 0, "ran", N_PROMPTS)
    assert r["nodes"]["train"]["changed"] == [override.split("=")[0]]


@pytest.mark.parametrize("module, expected", [
    ("cache_latents", (N_IMAGES, 0, "ran", N_PROMPTS)),
    ("cache_text", (0, "all", "ran", N_PROMPTS)),  # "all": every distinct text of the workspace
    ("train", (0, 0, "ran", N_PROMPTS)),
    ("sample", (0, 0, "cached", N_PROMPTS)),
])
def test_code_version_of_one_node_changed(workspace, monkeypatch, module, expected):
    import importlib

    # a node's version lives with its key: the train node's in tasks/training/train_key.py
    where = "tasks.training.train_key" if module == "train" else f"tasks.{module}"
    monkeypatch.setattr(importlib.import_module(where), "CODE_VERSION", "bumped-by-test")
    r = workspace.run()
    if expected[1] == "all":
        expected = (expected[0], distinct_texts(workspace), *expected[2:])
    assert counts(r) == expected


def test_other_model_weights_recompute_everything(workspace):
    # model.seed builds a tiny model with other weights: every component's identity (a digest of its
    # files) changes, so every latent, text and sample is recomputed -- the path of the model is not the key.
    r = workspace.run("model.seed=1")
    assert counts(r) == (N_IMAGES, distinct_texts(workspace), "ran", N_PROMPTS)
    assert "vae" in r["nodes"]["cache_latents"]["changed"] and "encoders" in r["nodes"]["cache_text"]["changed"]


def test_training_scheduler_config_edited(workspace):
    # The train loop loads the model's scheduler/ (shift, prediction_type): an edit there retrains (and
    # resumes no checkpoint of the old trajectory); latents and text are reused.
    import json

    model = workspace.root / "model"
    shutil.copytree(next((workspace.store / "models").rglob("model_index.json")).parent, model)
    assert counts(workspace.run(f"model.path={model}")) == (0, 0, "cached", 0)  # identities, not paths
    config = model / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "shift": 2.0}))
    r = workspace.run(f"model.path={model}")
    assert counts(r) == (0, 0, "ran", N_PROMPTS)
    assert "continued_from_step" not in r["nodes"]["train"]


def test_pipeline_option_in_model_index_edited(workspace, tmp_path):
    # model_index.json options change sampling (SDXL's force_zeros_for_empty_prompt: the CFG negative):
    # an edit re-renders every sample, and nothing else.
    import json

    from tasks.models.tiny.tiny_unet import build_tiny_sdxl

    model = build_tiny_sdxl(tmp_path / "sdxl")
    workspace.run("model=tiny_sdxl", f"model.path={model}")
    index = model / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "force_zeros_for_empty_prompt": False}))
    r = workspace.run("model=tiny_sdxl", f"model.path={model}")
    assert counts(r) == (0, 0, "cached", N_PROMPTS)


def test_image_edited_between_validate_and_cache_latents(workspace, monkeypatch):
    # A new image (its caption the same text as img_00's) is edited after validate digested it: that run
    # fails naming it, nothing stored under the old bytes' key; the next run reuses the new bytes' latent.
    from tasks import cache_latents

    path, real = workspace.data / "img_new.png", cache_latents.read_image
    img = Image.open(workspace.data / "img_00.png").convert("RGB")
    img.putpixel((0, 0), (1, 2, 3))
    img.save(path)
    shutil.copyfile(workspace.data / "img_00.txt", workspace.data / "img_new.txt")

    def edit_then_read(p):
        if str(p) == str(path) and not getattr(edit_then_read, "done", False):
            edit_then_read.done = True
            img.putpixel((0, 0), (4, 5, 6))
            img.save(path)
        return real(p)

    monkeypatch.setattr(cache_latents, "read_image", edit_then_read)
    with pytest.raises(Exception, match="changed on disk after validate: img_new.png"):
        workspace.run()
    monkeypatch.undo()
    assert counts(workspace.run()) == (0, 0, "ran", N_PROMPTS)
