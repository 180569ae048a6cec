"""Issue 32: train.blocks_to_swap (tasks/training/block_swap.py). On the CPU the swap's code path runs (every
frozen layer of a swapped block through the stored-weight Function, its weight held by the hook, off the
module) and the LoRA is byte-identical with and without it, also on a quantized base; the module's own
parameters shrink by what moved (what `.to(device)` would carry); refusals name the key."""
from __future__ import annotations

import pytest
import torch

from tasks import cache_latents, cache_text, train, validate
from tasks.config import ConfigError, compose, resolve_paths, updated
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
    store = Store(cfg.store.root)
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
    adapter = make_adapter(cfg.model, plan.model_dir)
    full, _ = prepare_denoiser(adapter, updated(cfg, {"train.blocks_to_swap": 0}))
    swapped, _ = prepare_denoiser(adapter, cfg)
    last = blocks(swapped, adapter.swap_blocks)[-1]
    frozen = [m for n, m in last.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n
              and not any(p.requires_grad for p in m.parameters(recurse=False))]
    assert frozen and all(m.weight.numel() == 0 for m in frozen)  # placeholders; the hook holds each weight
    moved = sum(m._diffusers_hook.get_hook("layerwise_casting").host_weight.host.numel() for m in frozen)
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
        prepare_denoiser(make_adapter(cfg.model, plan.model_dir), cfg)  # and the swap itself


def test_train_loads_neither_vae_nor_text_encoders_with_complete_caches(tmp_path, monkeypatch):
    """Issue 32: with the caches complete, the train node holds the denoiser alone (samples during training
    included: their prompts are cached too)."""
    from tasks.models.flux import FluxAdapter

    cfg = _cfg(tmp_path, "train.blocks_to_swap=1", "sample.every_n_steps=2", "sample.steps=2")
    store = Store(cfg.store.root)
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)

    def refused(self):
        raise AssertionError("loaded during train")
    monkeypatch.setattr(FluxAdapter, "load_vae", refused)
    monkeypatch.setattr(FluxAdapter, "load_text_encoders", refused)
    out = train.run(cfg, plan, store, lat["items"], txt["items"])
    assert out["computed"] == 1


@pytest.fixture
def copy_on_host(monkeypatch):
    """The swap's copies run on the CPU too (there the weights are otherwise used where they are): the scheduling
    a GPU runs, each copy a real one, checked here."""
    from tasks.training.block_swap import BlockSwap

    monkeypatch.setattr(BlockSwap, "copy_on_host", True)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_copies_run_a_block_ahead_two_blocks_at_most(tmp_path, copy_on_host, checkpointing):
    """Forward: block i's copy waited for, block i+1's started; backward (where gradient checkpointing recomputes
    each block) the same in reverse; every block one copy a pass, never more than two on the device, and the
    gradients those copies give equal the unswapped model's, bit for bit."""
    cfg = _cfg(tmp_path, "+model.arch.num_layers=2", "+model.arch.num_single_layers=2", "train.blocks_to_swap=3",
               f"train.gradient_checkpointing={str(checkpointing).lower()}")
    plan = validate.run(cfg, Store(tmp_path / "store"))
    adapter = make_adapter(cfg.model, plan.model_dir)
    latents, text = _one_input(adapter, cfg, plan)
    grads = []
    for n in (0, 3):
        torch.manual_seed(0)  # the LoRA's initial weights
        denoiser, named = prepare_denoiser(adapter, updated(cfg, {"train.blocks_to_swap": n}))
        denoiser.train()
        loss = adapter.training_loss(denoiser, latents, text, cfg.train, adapter.load_train_scheduler(),
                                     [torch.Generator().manual_seed(0)])
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in named.items()})
    swap = denoiser.loraflow_block_swap
    assert list(swap.copied) == [(0, 1), (1, 1), (2, 1), (1, -1), (0, -1)]
    assert swap.most_resident == 2
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    assert any(g.abs().sum() > 0 for g in grads[1].values())  # lora_B's: lora_A's are zero while B is


def test_the_lora_is_byte_identical_through_the_copies(tmp_path, copy_on_host):
    plain = _lora_bytes(_cfg(tmp_path / "a", "train.gradient_checkpointing=true"))
    swapped = _lora_bytes(_cfg(tmp_path / "b", "train.blocks_to_swap=2", "train.gradient_checkpointing=true"))
    assert plain == swapped


def test_a_block_is_one_buffer_and_its_weights_views_of_it(tmp_path):
    cfg = _cfg(tmp_path, "train.blocks_to_swap=2", "model.quantize=fp8")
    plan = validate.run(cfg, Store(tmp_path / "store"))
    denoiser, _ = prepare_denoiser(make_adapter(cfg.model, plan.model_dir), cfg)
    swap = denoiser.loraflow_block_swap
    for buffer, hosts in zip(swap.buffers, swap.hosts):
        assert buffer.dtype == torch.uint8 and hosts
        assert all(h.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for h in hosts)
        assert any(h.dtype == torch.float8_e4m3fn for h in hosts)


def _one_input(adapter, cfg, plan):
    """The first demo image's cached latent and caption text, as a batch of one."""
    store = Store(cfg.store.root)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    name = plan.items[0]["name"]
    latents = store.get_tensors(cache_latents.KIND, lat["items"][name])["latents"][None].to(adapter.dtype)
    key = txt["items"][f"caption:{name}"]
    text = {k: v[None] for k, v in store.get_tensors(cache_text.KIND, key).items()}
    return latents, text
