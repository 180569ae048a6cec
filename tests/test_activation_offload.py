"""train.gradient_checkpointing_offload (tasks/training/activation_offload.py): the checkpointed blocks' inputs wait
on the host. The graph is plain checkpointing's: the LoRA is byte-identical to it, for a transformer under bf16
autocast, a UNet and a quantized base with a swapped block; every block's saved inputs are copied to host
memory (a real copy on the CPU too) and leave what the graph holds; the preflight moves them to host_gb; refusals name
the keys."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks import cache_latents, cache_text, train, validate
from tasks.config import compose, resolve_paths, updated
from tasks.models import make_adapter
from tasks.store import Store
from tasks.training import activation_offload
from tasks.training.memory import GB, estimate, fitting_settings
from tasks.training.train_setup import prepare_denoiser

REPO = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, *extra):
    return resolve_paths(compose("train", [
        f"data.dir={REPO / 'data' / 'demo'}", f"store.root={tmp_path / 'store'}", "data.resolution=32",
        "train.max_steps=3", "train.batch_size=2", "train.log_with=none", "sample.every_n_steps=0",
        "train.gradient_checkpointing=true", *extra])[0])


def _lora_bytes(cfg) -> bytes:
    store = Store(cfg.store.root)
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return open(train.run(cfg, plan, store, lat["items"], txt["items"])["lora"], "rb").read()


@pytest.mark.parametrize("model,extra", [
    ("tiny_flux", ["train.mixed_precision=bf16"]),  # the recompute replays the forward's autocast
    ("tiny_sd15", []),  # a UNet: its resnets and attention blocks, skip connections
    ("tiny_qwenimage", ["model.quantize=int8", "model.dtype=bfloat16", "train.blocks_to_swap=1"])])
def test_the_lora_is_byte_identical_with_and_without_offload(tmp_path, model, extra):
    plain = _lora_bytes(_cfg(tmp_path / "a", f"model={model}", *extra))
    offloaded = _lora_bytes(_cfg(tmp_path / "b", f"model={model}", "train.gradient_checkpointing_offload=true", *extra))
    assert plain == offloaded


def test_block_inputs_wait_on_the_host_not_in_the_graph(tmp_path, monkeypatch):
    cfg, store = _cfg(tmp_path, "model=tiny_flux", "train.mixed_precision=bf16"), Store(tmp_path / "store")
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    adapter = make_adapter(cfg.model, plan.model_dir)
    names = [it["name"] for it in plan.items[:2]]
    latents = torch.stack([store.get_tensors(cache_latents.KIND, lat["items"][n])["latents"] for n in names])
    texts = [store.get_tensors(cache_text.KIND, txt["items"][cache_text.caption_name(n, "full.v0")]) for n in names]
    text = {k: torch.stack([t[k] for t in texts]) for k in texts[0]}
    copies = []

    class Counting(torch.autograd.graph.save_on_cpu):  # save_on_cpu, counting what it takes to the host
        def __init__(self, pin_memory=False):
            super().__init__(pin_memory)
            pack = self.pack_hook

            def counted(t):
                copies.append(t.numel())
                return pack(t)
            self.pack_hook = counted

    def step(offload: bool):
        torch.manual_seed(0)
        den, named = prepare_denoiser(adapter, updated(cfg, {"train.gradient_checkpointing_offload": offload}))
        saved = {}

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            loss = adapter.training_loss(den, latents, text, cfg.train, adapter.load_train_scheduler(),
                                         [torch.Generator().manual_seed(i) for i in range(2)])
        loss.backward()
        return sum(saved.values()), {n: p.grad.clone() for n, p in named.items() if p.grad is not None}

    plain_saved, plain_grads = step(False)
    monkeypatch.setattr(activation_offload, "save_on_cpu", Counting)
    saved, grads = step(True)
    blocks = len(adapter.load_denoiser().transformer_blocks) + len(adapter.load_denoiser().single_transformer_blocks)
    assert len(copies) >= blocks and sum(copies) > 0  # every block's saved inputs went through the host copy
    assert saved < plain_saved  # and are not among what the graph saves
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)


def test_preflight_moves_the_block_inputs_to_the_host(tmp_path):
    cfg = _cfg(tmp_path, "model=tiny_flux", "train.mixed_precision=bf16", "train.batch_size=1", "model.quantize=nf4",
               "model.dtype=bfloat16")
    adapter = make_adapter(cfg.model, validate.run(cfg, Store(tmp_path / "store")).model_dir)
    cfg.train.optimizer = "adamw8bit"  # (validate refuses it without CUDA): the estimate's remedies all taken

    def est(c):
        return estimate(c, adapter.model_dir, adapter.denoiser_subfolder, adapter.default_lora_targets(), (1024, 1024),
                        512, adapter.denoiser_cls, adapter.swap_blocks, geometry=adapter.activation_geometry)
    plain = est(cfg)
    off = est(updated(cfg, {"train.gradient_checkpointing_offload": True}))
    config = adapter.load_denoiser().config
    blocks = config.num_layers + config.num_single_layers
    unit = ((1024 // 16) ** 2 + 512) * config.num_attention_heads * config.attention_head_dim * 2  # tokens x width, bf16
    assert off["host_gb"] == pytest.approx(blocks * unit / GB, rel=1e-9) and plain["host_gb"] == 0
    # what left the device is what reached the host, less the one block input back for its recompute
    assert plain["activations_gb"] - off["activations_gb"] == pytest.approx((blocks - 1) * unit / GB, rel=1e-9)
    # where nothing else but swapping would fit, the offload is named first (no block swapped)
    budget = (off["total_gb"] + plain["total_gb"]) / 2
    fits = fitting_settings(cfg, budget, est, max_swap=blocks)
    assert fits and fits[0].startswith("train.gradient_checkpointing_offload=true (") , fits


def test_offload_without_checkpointing_is_refused(tmp_path):
    errors = validate.config_errors(_cfg(tmp_path, "train.gradient_checkpointing=false",
                                         "train.gradient_checkpointing_offload=true"))
    assert any(e.startswith("train.gradient_checkpointing_offload=true") and "train.gradient_checkpointing=true" in e
               for e in errors), errors
