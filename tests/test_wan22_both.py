"""Wan 2.2's `model.expert=both` (tasks/models/wan22_experts.py): one LoRA trained on both experts in one run, as
musubi-tuner's `--dit_high_noise` trains it, each item's timestep through its expert; the file loads into both.
And the low expert's own weights (`transformer_2`) under its LoRA when it trains alone."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks import cache_latents, cache_text, publish, train, validate
from tasks.config import ConfigError
from tasks.models import make_adapter
from tasks.store import Store
from tasks.training.memory import preflight
from tasks.training.train_setup import prepare_denoiser
from tests.test_wan22 import _cfg, root  # noqa: F401 (the fixture: a clip and a still)


def _adapter(cfg, store):
    plan = validate.run(cfg, store)
    return make_adapter(cfg.model, Path(plan.model_dir)), plan


def test_low_expert_trains_on_transformer_2(root):
    from diffusers import WanTransformer3DModel

    adapter, plan = _adapter(_cfg(root, "model.expert=low"), Store(root / "store"))
    got = adapter.load_denoiser().state_dict()
    want = WanTransformer3DModel.from_pretrained(plan.model_dir, subfolder="transformer_2").state_dict()
    high = WanTransformer3DModel.from_pretrained(plan.model_dir, subfolder="transformer").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(got[k], high[k]) for k in high)  # the tiny experts differ (seeds 2 and 3)


def test_one_set_of_lora_weights_trained_by_both_experts(root):
    cfg = _cfg(root, "model.expert=both")
    adapter, _ = _adapter(cfg, Store(root / "store"))
    denoiser, named = prepare_denoiser(adapter, cfg)
    high, low = dict(denoiser.high.named_parameters()), dict(denoiser.low.named_parameters())
    lora = [n for n, p in high.items() if p.requires_grad]
    assert lora and all(high[n] is low[n] for n in lora)  # the same Parameter objects
    assert sorted(named) == sorted(f"high.{n}" for n in lora)  # the optimizer sees each once
    base = [n for n, p in high.items() if not p.requires_grad]
    assert not all(torch.equal(high[n], low[n]) for n in base)  # two different experts under it

    # each item through its expert: t >= boundary (875) the high one, else the low one, in the batch's order
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 3, 4, 4, generator=g)
    text = torch.randn(4, cfg.model.max_sequence_length, 32, generator=g)
    t = torch.tensor([900.0, 100.0, 950.0, 10.0])
    with torch.no_grad():
        out = denoiser(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        hi = denoiser.high(hidden_states=x[[0, 2]], timestep=t[[0, 2]], encoder_hidden_states=text[[0, 2]], return_dict=False)[0]
        lo = denoiser.low(hidden_states=x[[1, 3]], timestep=t[[1, 3]], encoder_hidden_states=text[[1, 3]], return_dict=False)[0]
    # exact: the same calls on the same rows, put back in the batch's order
    assert torch.equal(out[[0, 2]], hi) and torch.equal(out[[1, 3]], lo)

    # a high-noise step and a low-noise step each move the one LoRA, differently
    grads = {}
    for side, steps in (("high", torch.tensor([900.0, 950.0])), ("low", torch.tensor([100.0, 10.0]))):
        denoiser.zero_grad(set_to_none=True)
        denoiser(hidden_states=x[:2], timestep=steps, encoder_hidden_states=text[:2], return_dict=False)[0].square().mean().backward()
        grads[side] = torch.cat([p.grad.flatten() for p in named.values() if p.grad is not None])
    # lora_B starts at zero (peft's gaussian init): only the B halves get a gradient at step 0
    assert grads["high"].abs().sum() > 0 and grads["low"].abs().sum() > 0
    assert not torch.equal(grads["high"], grads["low"])


def test_both_trains_and_loads_into_both_experts(root):
    from diffusers import WanPipeline

    cfg, store = _cfg(root, "model.expert=both", "export.format=both", "train.max_steps=3"), Store(root / "store")
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, lat["items"], txt["items"])
    assert lora["lora"] and len(lora["losses"]) >= 1
    file = publish.diffusers_file(store, lora)
    sd = load_file(str(file))
    assert sd and all(k.startswith("transformer.blocks.") for k in sd)  # one expert's layout, loaded twice
    assert any(v.abs().sum() > 0 for k, v in sd.items() if "lora_B" in k)  # trained
    for f in (file, publish.kohya_file(cfg, plan, store, lora)):
        pipe = WanPipeline.from_pretrained(plan.model_dir, use_safetensors=True)
        pipe.load_lora_weights(str(f))
        pipe.load_lora_weights(str(f), load_into_transformer_2=True)
        a, b = pipe.transformer.state_dict(), pipe.transformer_2.state_dict()
        loaded = [k for k in a if "lora_" in k]
        assert loaded and all(torch.equal(a[k], b[k]) for k in loaded)
    # the sampler puts the LoRA into both experts, the same weights as the file
    pipe = make_adapter(cfg.model, Path(plan.model_dir)).load_sampler(Path(lora["lora"]))
    for expert in (pipe.transformer, pipe.transformer_2):
        mine = {re.sub(r"\.default(_\d+)?\.", ".", k): v for k, v in expert.state_dict().items() if "lora_" in k}
        assert all(torch.equal(mine[k.removeprefix("transformer.")], v) for k, v in sd.items())
    # a second run of the same config gives the same bytes (determinism on the CPU)
    again = train.train_lora(cfg, plan, store, lat["items"], txt["items"], root / "again", "trajectory-again")
    from tasks.store.stored_files import canonicalize_safetensors
    canonicalize_safetensors(again["lora"])
    assert Path(again["lora"]).read_bytes() == Path(lora["lora"]).read_bytes()


def test_preflight_counts_both_experts(root):
    store = Store(root / "store")
    one, _ = _adapter(_cfg(root, "model.expert=high"), store)
    cfg = _cfg(root, "model.expert=both")
    both, plan = _adapter(cfg, store)
    size = (32, 32)
    e1, e2 = preflight(_cfg(root, "model.expert=high"), one, size), preflight(cfg, both, size)
    assert e2["params"] == 2 * e1["params"]
    assert e2["lora_and_optimizer_gb"] == e1["lora_and_optimizer_gb"]  # one LoRA
    assert e2["weights_gb"] == pytest.approx(2 * e1["weights_gb"], rel=1e-9)
    blocks = len(both.load_denoiser().low.blocks)
    every = preflight(_cfg(root, "model.expert=both", f"train.blocks_to_swap={2 * blocks}"), both, size)
    assert every["host_gb"] > 0 and every["host_gb"] == pytest.approx(2 * preflight(
        _cfg(root, "model.expert=high", f"train.blocks_to_swap={blocks}"), one, size)["host_gb"], rel=1e-9)
    with pytest.raises(ConfigError, match=f"train.blocks_to_swap={2 * blocks + 1}: the 2 experts have {2 * blocks}"):
        preflight(_cfg(root, "model.expert=both", f"train.blocks_to_swap={2 * blocks + 1}"), both, size)


def test_dora_with_both_is_refused_naming_the_keys(root):
    with pytest.raises(ConfigError, match="train.network=dora with model.expert=both"):
        validate.run(_cfg(root, "model.expert=both", "train.network=dora"), Store(root / "store"))


def test_one_lora_on_both_experts_memorises_its_clip(tmp_path):
    """bench/learns.py's check for `tiny_wan22+both`: one 9-frame clip memorised, rendered by WanPipeline with
    the file loaded into both experts (0.128 on the AVX2 kernels `make test` forces, 0.133 on AVX-512 in
    bench/learns.json, after 900 steps; either expert's LoRA alone
    leaves the other's steps unadapted: high 0.829, low 0.172 after 600, docs/learning.md). A halved scale is
    caught."""
    from bench import learns
    from learning import FILES, learns_within_bound

    base, files, _ = learns_within_bound("tiny_wan22+both", tmp_path)
    bad = tmp_path / "halved.safetensors"
    FILES["scale_halved"](files["kohya"], bad)
    assert learns.evaluate("tiny_wan22+both", base, {"kohya": bad})["files"]["kohya"] > learns.BOUND
