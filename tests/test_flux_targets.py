"""Flux LoRA targets (issue 18, item 4): the blocks' projections by full path, never the top-level
proj_out (the final layer), which neither diffusers' Flux LoRA example nor sd-scripts trains."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
from peft import LoraConfig  # noqa: E402

from tasks.config_schema import TrainConfig
from tasks.models.flux import FluxAdapter  # noqa: E402
from tasks.models.tiny.tiny_flux import build_tiny_flux  # noqa: E402
from support import a_plan  # noqa: E402


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return FluxAdapter(build_tiny_flux(tmp_path_factory.mktemp("tiny_flux")))


def _lora_modules(adapter, targets):
    model = adapter.load_denoiser()
    model.add_adapter(LoraConfig(r=4, target_modules=targets))
    return model, {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}


def test_default_targets_are_the_blocks_only(adapter):
    model, modules = _lora_modules(adapter, adapter.default_lora_targets())
    assert "proj_out" not in modules  # the final layer
    assert all(m.startswith(("transformer_blocks.", "single_transformer_blocks.")) for m in modules)
    # every attention / MLP projection of both block types, the single blocks' proj_out included
    expected = {"transformer_blocks.0." + m for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                      "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                                                      "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                                                      "ff_context.net.0.proj", "ff_context.net.2")}
    expected |= {"single_transformer_blocks.0." + m for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")}
    assert modules == expected


def test_memory_estimate_counts_the_same_modules(adapter):
    from tasks.training.memory import lora_params, lora_targets

    targets = lora_targets(TrainConfig(target_modules=None), adapter)
    model, _ = _lora_modules(adapter, targets)
    shapes = {n: list(p.shape) for n, p in model.named_parameters() if "lora_" not in n}
    shapes = {n.replace(".base_layer", ""): s for n, s in shapes.items()}
    n_lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert lora_params(shapes, targets, 4) == n_lora


def test_explicit_targets_keep_suffix_matching(adapter):
    from tasks.training.memory import lora_targets

    assert lora_targets(TrainConfig(target_modules=["to_q"]), adapter) == ["to_q"]


def test_only_flux_train_keys_change():
    # The family's own version enters the LoRA key (its bytes changed); the other families' keys stay.
    from tasks.training.train_key import _family_version

    assert _family_version(a_plan(family="flux")) == {"family_version": "2"}
    assert _family_version(a_plan(family="sd3")) == _family_version(a_plan(family="sdxl")) == {}
