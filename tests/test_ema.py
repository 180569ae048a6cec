"""train.ema_decay (issue 22, item 5): an EMA of the LoRA weights, kept in checkpoints (resume stays exact),
stored by the train node and exported beside the plain LoRA as <run dir>/lora/pytorch_lora_weights_ema.safetensors
(artifacts.lora_files.ema), loadable with the pipeline's load_lora_weights. In the train key only when set."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tasks.config_schema import TrainConfig
from tasks import cache_latents, cache_text, train, validate
from tasks.config import compose, resolve_paths
from tasks.publish import publish
from tasks.store import Store
from tasks.training.train_setup import make_ema, update_ema
from tolerance import assert_close

EMA = ("train.ema_decay=0.5",)


def _cfg(*overrides):
    return resolve_paths(compose("train", list(overrides))[0])


def _train(store_root, *extra, run_dir=None):
    cfg = _cfg(f"store.root={store_root}", "train.batch_size=2", "train.log_with=none", "export.format=diffusers", *extra)
    store = Store(store_root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, latents["items"], texts["items"])
    return lora, (publish(cfg, plan, store, run_dir, lora, []) if run_dir else None), plan


def test_ema_of_a_known_sequence():
    w = {"a": torch.nn.Parameter(torch.tensor([0.0, 4.0]))}
    assert make_ema(TrainConfig(ema_decay=None), w) is None
    ema = make_ema(TrainConfig(ema_decay=0.5), w)  # starts at the initial weights
    for value in ([1.0, 0.0], [2.0, 0.0], [3.0, 8.0]):
        with torch.no_grad():
            w["a"].copy_(torch.tensor(value))
        update_ema(ema, w, 0.5)
    # 0.5*0 + 0.5*1 = 0.5; 0.5*0.5 + 0.5*2 = 1.25; 0.5*1.25 + 0.5*3 = 2.125 | 4 -> 2 -> 1 -> 4.5
    assert ema["a"].tolist() == [2.125, 4.5]
    ema = make_ema(TrainConfig(ema_decay=0.9), w)
    update_ema(ema, {"a": torch.nn.Parameter(torch.tensor([13.0, -2.0]))}, 0.9)
    assert_close(ema["a"], torch.tensor([0.9 * 3 + 0.1 * 13, 0.9 * 8 - 0.1 * 2]), n=2, what="ema")  # a float32 lerp


def test_ema_decay_enters_the_key_only_when_set_and_is_checked():
    from tasks.validate import config_errors

    plain = _cfg()
    assert plain.train.ema_decay is None and config_errors(plain) == []
    for bad in ("0", "1", "1.5", "-0.1", "nan"):
        errors = config_errors(_cfg(f"train.ema_decay={bad}"))
        assert errors and all("train.ema_decay" in e for e in errors), (bad, errors)


def test_resume_is_exact_with_ema_and_the_ema_file_loads(tmp_path):
    straight, published, plan = _train(tmp_path / "a", "train.max_steps=4", *EMA, run_dir=tmp_path / "run")
    assert straight["inputs"]["train.ema_decay"] == 0.5
    _train(tmp_path / "b", "train.max_steps=2", *EMA)
    continued, _, _ = _train(tmp_path / "b", "train.max_steps=4", *EMA)
    assert continued["continued_from_step"] == 2
    for key in ("lora", "lora_ema"):
        assert Path(straight[key]).read_bytes() == Path(continued[key]).read_bytes(), key

    # the plain LoRA is that of a run without EMA (same bytes); only the key differs
    off, _, _ = _train(tmp_path / "a", "train.max_steps=4")
    assert "train.ema_decay" not in off["inputs"] and "lora_ema" not in off and off["key"] != straight["key"]
    assert Path(off["lora"]).read_bytes() == Path(straight["lora"]).read_bytes()

    files = published["lora_files"]
    assert set(files) == {"diffusers", "comfyui", "ema"} and published["lora"] == files["diffusers"]
    assert Path(files["ema"]) == tmp_path / "run" / "lora" / "pytorch_lora_weights_ema.safetensors"
    plain_sd, ema_sd = load_file(files["diffusers"]), load_file(files["ema"])
    assert plain_sd.keys() == ema_sd.keys() and any(not torch.equal(plain_sd[k], ema_sd[k]) for k in plain_sd)

    from diffusers import DiffusionPipeline

    def lora_weights(lora_file):
        pipe = DiffusionPipeline.from_pretrained(plan.model_dir, use_safetensors=True)
        pipe.load_lora_weights(lora_file)
        return {k: v.clone() for k, v in pipe.transformer.state_dict().items() if "lora_B" in k}

    loaded_plain, loaded_ema = lora_weights(files["diffusers"]), lora_weights(files["ema"])
    assert loaded_ema and any(not torch.equal(loaded_plain[k], loaded_ema[k]) for k in loaded_ema)

    # a lost EMA entry is made again from the last checkpoint, the same bytes, without training
    store = Store(tmp_path / "a")
    ema_bytes = Path(straight["lora_ema"]).read_bytes()
    store.discard(train.EMA_KIND, straight["key"])
    again, _, _ = _train(tmp_path / "a", "train.max_steps=4", *EMA)
    assert again["continued_from_step"] == 4 and Path(again["lora_ema"]).read_bytes() == ema_bytes
