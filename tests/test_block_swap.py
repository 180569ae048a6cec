"""Issue 32: train.blocks_to_swap (tasks/training/block_swap.py). On the CPU the swap's code path runs (every
frozen layer of a swapped block through the stored-weight Function, its weight held by the hook, off the
module) and the LoRA is byte-identical with and without it, also on a quantized base; the module's own
parameters shrink by what moved (what `.to(device)` would carry); refusals name the key."""
from __future__ import annotations

import pytest
import torch

from tasks import cache_latents, cache_text, train, validate
from tasks.config import ConfigError, compose, resolve_paths
from tasks.models import make_adapter
from tasks.store import Store
from tasks.training.block_swap import blocks
from tasks.training.train_setup import prepare_denoiser

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def _cfg(tmp_path, *extra):
    return resolve_paths(compose("train", [
        f"data.dir={REPO / 'data' / 'demo'}", f"store.root={tmp_path / 'store'}", "data.resolution=32",
        "train.max_steps=3", "train.batch_size=2", "train.log_with=none", "sample.every_n_steps=0", *extra])[0])


def _lora_bytes(cfg) -> bytes:
    store = Store(cfg["store"]["root"])
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    out = train.run(cfg, plan, store, lat["items"], txt["items"])
    return open(out["lora"], "rb").read()


@pytest.mark.parametrize("model,extra", [("tiny_flux", []), ("tiny_qwenimage", ["model.quantize=int8", "model.dtype=bfloat16"])])
def test_the_lora_is_byte_identical_with_and_without_swap(tmp_path, model, extra):
    plain = _lora_bytes(_cfg(tmp_path / "a", f"model={model}", *extra))
    swapped = _lora_bytes(_cfg(tmp_path / "b", f"model={model}", "train.blocks_to_swap=2", *extra))
    assert plain == swapped


def test_swapped_weights_leave_the_module(tmp_path):
    cfg = _cfg(tmp_path, "train.blocks_to_swap=1")
    plan = validate.run(cfg, Store(tmp_path / "store"))
    adapter = make_adapter(cfg["model"], plan["model_dir"])
    full, _ = prepare_denoiser(adapter, {**cfg, "train": {**cfg["train"], "blocks_to_swap": 0}})
    swapped, _ = prepare_denoiser(adapter, cfg)
    last = blocks(swapped, adapter.swap_blocks)[-1]
    frozen = [m for n, m in last.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n
              and not any(p.requires_grad for p in m.parameters(recurse=False))]
    assert frozen and all(m.weight.numel() == 0 for m in frozen)  # placeholders; the hook holds each weight
    moved = sum(m._diffusers_hook.get_hook("layerwise_casting").host_weight.numel() for m in frozen)
    count = lambda d: sum(p.numel() for p in d.parameters())  # noqa: E731 -- what .to(device) carries
    assert count(full) - count(swapped) == moved > 0


def test_refusals(tmp_path):
    def errors(*o):
        return validate.config_errors(_cfg(tmp_path, *o))
    assert any("model.family=sdxl has no transformer blocks to swap" in e
               for e in errors("model=tiny_sdxl", "train.blocks_to_swap=2"))
    assert any("train.network=dora with train.blocks_to_swap" in e
               for e in errors("train.blocks_to_swap=1", "train.network=dora"))
    cfg = _cfg(tmp_path, "train.blocks_to_swap=99")
    with pytest.raises(ConfigError, match=r"train.blocks_to_swap=99: this model has 2 transformer blocks"):
        validate.run(cfg, Store(tmp_path / "store"))  # the preflight counts the blocks
    plan = validate.run(_cfg(tmp_path), Store(tmp_path / "store"))
    with pytest.raises(ConfigError, match=r"train.blocks_to_swap=99: this model has 2 transformer blocks"):
        prepare_denoiser(make_adapter(cfg["model"], plan["model_dir"]), cfg)  # and the swap itself


def test_train_loads_neither_vae_nor_text_encoders_with_complete_caches(tmp_path, monkeypatch):
    """Issue 32: with the caches complete, the train node holds the denoiser alone (samples during training
    included: their prompts are cached too)."""
    from tasks.models.flux import FluxAdapter

    cfg = _cfg(tmp_path, "train.blocks_to_swap=1", "sample.every_n_steps=2", "sample.steps=2")
    store = Store(cfg["store"]["root"])
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)

    def refused(self):
        raise AssertionError("loaded during train")
    monkeypatch.setattr(FluxAdapter, "load_vae", refused)
    monkeypatch.setattr(FluxAdapter, "load_text_encoders", refused)
    out = train.run(cfg, plan, store, lat["items"], txt["items"])
    assert out["computed"] == 1
