"""LoRA variants through peft (issue 22, item 2): train.network=dora and train.rslora=true train, and the exported
files load with the family pipeline's load_lora_weights to the trained adapter's function; DoRA's kohya file
carries dora_scale. loha/lokr: tests/test_lycoris.py."""
from __future__ import annotations

import pytest
import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from tasks import cache_latents, cache_text, publish, train, validate
from tasks.config import compose, resolve_paths
from tasks.models import adapter_class
from tasks.store import Store
from tasks.training.train_setup import prepare_denoiser
from tolerance import assert_close, rounding, sums


def _cfg(*overrides):
    return resolve_paths(compose("train", list(overrides))[0])


def test_variants_refused_where_no_loader_reads_them():
    # LoHa/LoKr train and export (tests/test_lycoris.py); DoRA exports to every format (its dora_scale: tests/test_comfyui_keys.py), but the text encoders' DoRA only
    # to the diffusers file
    assert not validate.config_errors(_cfg("train.network=dora"))
    assert any(e.startswith("train.network=dora with train.text_encoder_lr and export.format=both")
               for e in validate.config_errors(_cfg("train.network=dora", "train.text_encoder_lr=1e-5")))
    assert not validate.config_errors(_cfg("train.network=dora", "export.format=diffusers", "train.rslora=true"))


def _lora_outputs(denoiser, x_gen_seed=0):
    """Each LoRA-wrapped Linear's output on a fixed input: the adapter's function, module by module."""
    gen, out = torch.Generator().manual_seed(x_gen_seed), {}
    with torch.no_grad():
        for name, m in denoiser.named_modules():
            if hasattr(m, "base_layer") and isinstance(m.base_layer, torch.nn.Linear):
                x = torch.randn(2, m.base_layer.in_features, generator=gen)
                out[name] = (m(x), m.base_layer(x))
    return out


DORA, RSLORA = ["train.network=dora", "export.format=diffusers"], ["train.rslora=true", "train.alpha=16"]


@pytest.mark.numerics
@pytest.mark.parametrize("family,overrides", [("sd15", DORA), ("sd15", RSLORA), ("sdxl", DORA), ("flux", DORA),
                                              ("flux", RSLORA), ("sd3", DORA)],
                         ids=["sd15-dora", "sd15-rslora", "sdxl-dora", "flux-dora", "flux-rslora", "sd3-dora"])
def test_exported_variant_loads_in_diffusers_as_trained(family, overrides, tmp_path):
    root = tmp_path / "store"
    cfg = _cfg(f"store.root={root}", f"model=tiny_{family}", "train.batch_size=2", "train.max_steps=2",
               "train.lr=0.01", "train.log_with=none", *overrides)
    store = Store(root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, latents["items"], texts["items"])
    assert {k for k in lora["inputs"] if k in ("train.network", "train.rslora")} == \
           {o.split("=")[0] for o in overrides if o.startswith(("train.network", "train.rslora"))}

    # the trained adapter, rebuilt as training builds it, with the stored weights
    adapter = adapter_class(family)(plan.model_dir, "float32", cfg.model.max_sequence_length)
    reference, _ = prepare_denoiser(adapter, cfg)
    stored = publish.peft_from_diffusers(load_file(lora["lora"]))
    assert any("lora_magnitude_vector" in k for k in stored) == ("train.network=dora" in overrides)
    set_peft_model_state_dict(reference, stored)
    expected = _lora_outputs(reference)
    width = sums(reference)["n"]  # the widest layer's input: terms in each of its sums

    files = {"diffusers": publish.diffusers_file(store, lora)}
    if cfg.export.format == "both" and family == "sd15":  # diffusers reads sd15 kohya files too
        files["kohya"] = publish.kohya_file(cfg, plan, store, lora)
    for fmt, file in files.items():
        pipe = adapter.pipeline_cls.from_pretrained(plan.model_dir, use_safetensors=True)
        pipe.load_lora_weights(str(file))
        got = _lora_outputs(getattr(pipe, adapter.denoiser_subfolder))
        assert set(got) == set(expected), fmt
        for name, (y, base) in expected.items():
            # one layer: the base product, A, B and (DoRA) the weight's norm, each a sum over in_features
            assert_close(got[name][0], y, n=width, stages=4, what=f"{fmt}: {name}")
        # the adapter does something: beyond rounding
        assert any((y - base).abs().max() > rounding(width, stages=4, magnitude=base.abs().max().item())
                   for y, base in expected.values())


def test_dora_with_the_default_export_writes_dora_scale(tmp_path):
    """train.network=dora with export.format=both: the kohya file (ComfyUI's too) holds a dora_scale per module,
    made from the base weights the train node loaded (their values: tests/test_comfyui_keys.py)."""
    root = tmp_path / "store"
    cfg = _cfg(f"store.root={root}", "model=tiny_sd15", "train.batch_size=2", "train.max_steps=1",
               "train.log_with=none", "train.network=dora")
    store = Store(root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, latents["items"], texts["items"])
    kohya = load_file(publish.kohya_file(cfg, plan, store, lora))
    modules = {k.split(".")[0] for k in kohya}
    assert modules and all(f"{m}.dora_scale" in kohya and kohya[f"{m}.dora_scale"].shape[1] == 1 for m in modules)
    assert all(kohya[f"{m}.dora_scale"].shape[0] == kohya[f"{m}.lora_up.weight"].shape[0] for m in modules)
