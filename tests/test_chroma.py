"""Chroma LoRAs (`model=tiny_chroma`, tasks/models/chroma.py and tiny_chroma.py): the tiny ChromaPipeline is built
offline, deterministically, with Chroma's geometry (FLUX.1's /8 VAE and 2x2 packing, T5 alone, the approximator).

- Text: what ChromaPipeline.encode_prompt returns, byte for byte (T5 with its mask; the mask keeping one pad token).
- One training step with a peft LoRA on the default targets: finite loss, non-zero LoRA gradients.
- `sample` from cached text is the pipeline's own image from the prompt strings, with and without CFG / a negative.
- The saved LoRA loads with ChromaPipeline.load_lora_weights and gives the trained model's output.
- The whole DAG through the CLI. The kohya file (BFL names, FLUX.1's rules) is the ComfyUI file: every key maps to
  a weight of ComfyUI's Chroma model and merges to the PEFT delta.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.config_schema import TrainConfig
from tasks.models.chroma import ChromaAdapter
from tasks.models.tiny.tiny_chroma import build_tiny_chroma

REPO = Path(__file__).resolve().parents[1]
L = 32  # T5 tokens (tiny_chroma.yaml's max_sequence_length)
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTIONS = ["a red box on a blue background", "blurry, flat colors", ""]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_chroma(tmp_path_factory.mktemp("tiny_chroma"))


@pytest.fixture(scope="module")
def adapter(model):
    return ChromaAdapter(model, "float32", L)


@pytest.fixture(scope="module")
def texts(adapter):
    return adapter.encode_text(adapter.load_text_encoders(), CAPTIONS)


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _pipe(model):
    from diffusers import ChromaPipeline

    pipe = ChromaPipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _lora(adapter, **kw):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets(), **kw))
    return denoiser


def test_build_is_deterministic_and_has_chromas_geometry(model, tmp_path):
    again = build_tiny_chroma(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = _pipe(model)
    t = pipe.transformer
    assert type(t).__name__ == "ChromaTransformer2DModel" and type(pipe.text_encoder).__name__ == "T5EncoderModel"
    assert pipe.vae_scale_factor == 8 and ChromaAdapter.size_multiple == 16  # /8, then 2x2 patches
    assert t.config.in_channels == 4 * pipe.vae.config.latent_channels
    assert t.config.joint_attention_dim == pipe.text_encoder.config.d_model
    # no per-block modulation Linears (the approximator makes them) and no pooled/guidance embedders
    names = {n for n, _ in t.named_modules()}
    assert not any(n.endswith(("norm1.linear", "norm1_context.linear", "norm.linear")) for n in names)
    assert "distilled_guidance_layer" in names and not any("guidance_embedder" in n for n in names)
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (0.3611, 0.1159)  # FLUX.1's VAE


def test_latents_are_what_the_pipeline_decodes(adapter):
    vae = adapter.load_vae()
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = adapter.encode_latents(vae, pixels)
    assert z.shape == (1, 4, 4, 6)
    raw = vae.encode(pixels).latent_dist.mode()  # the pipeline's latents / scaling_factor + shift_factor
    torch.testing.assert_close(z / vae.config.scaling_factor + vae.config.shift_factor, raw)


def test_text_is_encode_prompts_bytes(model, texts):
    pipe = _pipe(model)
    with torch.no_grad():
        embeds, _, mask, *_ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device="cpu",
                                                  max_sequence_length=L)
    for i, d in enumerate(texts):
        assert list(d) == ["prompt_embeds", "attention_mask"]
        assert d["prompt_embeds"].shape == (L, 32) and d["attention_mask"].shape == (L,)
        assert torch.equal(d["prompt_embeds"], embeds[i]) and torch.equal(d["attention_mask"], mask[i])
    ids = pipe.tokenizer(CAPTIONS, padding="max_length", max_length=L, return_tensors="pt").attention_mask
    assert torch.equal(mask.sum(1), ids.sum(1).float() + 1)  # the real tokens and the first padding token
    assert not torch.equal(texts[0]["prompt_embeds"], texts[2]["prompt_embeds"])


def test_one_training_step(adapter, texts):
    denoiser = _lora(adapter)
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    # per double block: 8 attention Linears and both feed-forwards' 4; per single block: q, k, v, proj_mlp, proj_out
    assert len(modules) == 12 + 5 and not any("distilled_guidance_layer" in m for m in modules)
    latents = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    text = {k: torch.stack([texts[0][k], texts[1][k]]) for k in texts[0]}
    loss = adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in lora.values() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("guidance,negative", [(4.0, None), (4.0, 1), (1.0, None)])
def test_sample_from_cached_text_is_the_pipelines_image(adapter, texts, model, guidance, negative):
    """CFG (guidance > 1) against the empty prompt or the prompt's negative, and without CFG."""
    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    image = adapter.sample(pipe, texts[0], texts[negative] if negative else None, texts[2], 64, 48, 2, guidance,
                           1.0, seed=0)
    assert image.size == (64, 48)
    ref = _pipe(model)(prompt=CAPTIONS[0], negative_prompt=CAPTIONS[negative] if negative else None, width=64,
                       height=48, num_inference_steps=2, guidance_scale=guidance, max_sequence_length=L,
                       generator=torch.Generator().manual_seed(0)).images[0]
    assert np.array_equal(np.asarray(image), np.asarray(ref))


def test_saved_lora_loads_with_load_lora_weights_and_gives_the_trained_output(adapter, texts, model, tmp_path):
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = _lora(adapter, lora_alpha=8, init_lora_weights="gaussian")
    optimizer = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)
    text = {k: v[None] for k, v in texts[0].items()}
    latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))

    pipe = _pipe(model)
    t = pipe.transformer
    inputs = dict(hidden_states=torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(3)),
                  timestep=torch.tensor([0.5]), encoder_hidden_states=text["prompt_embeds"],
                  txt_ids=torch.zeros(L, 3), img_ids=pipe._prepare_latent_image_ids(1, 2, 2, "cpu", torch.float32),
                  return_dict=False)
    with torch.no_grad():
        before = t(**inputs)[0]
        pipe.load_lora_weights(str(file))  # FluxLoraLoaderMixin, ChromaPipeline's own loader
        assert sum("lora_A" in n for n in t.state_dict()) == 17
        after = t(**inputs)[0]
        trained = denoiser(**inputs)[0]
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, trained)  # the file's alpha / rank scale (2.0) is the trained one


def test_whole_dag_through_the_cli(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> report through `python -m flows.train
    model=tiny_chroma` on the demo images at 32 px."""
    from conftest import cli_env

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "model=tiny_chroma", "train.max_steps=2", "sample.steps=2",
         "data.resolution=32", "train.log_with=none", f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=cli_env(tmp_path / "prefect-home"), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert all(report["nodes"][n]["status"] == "ran" for n in ("cache_latents", "cache_text", "train", "sample"))
    samples = report["artifacts"]["samples"]
    assert samples and all(s.endswith(".png") and Path(s).is_file() for s in samples)
    files = report["artifacts"]["lora_files"]
    assert {"diffusers", "kohya"} <= set(files) and all(Path(f).is_file() for f in files.values())
    assert files.get("comfyui", files["kohya"]) == files["kohya"]  # the kohya file is the ComfyUI file


# ComfyUI's Chroma model (comfyanonymous/ComfyUI; read here, it cannot be installed on these machines):
# - comfy/model_base.py (commit 9561b03cc7c95d276daf20ad778aeee2b47548b9, `class Chroma(Flux)`, near the end of the
#   file, before ACEStep): its model is comfy.ldm.chroma.model.Chroma;
# - comfy/ldm/chroma/model.py (cf738fb0b62ece8de34fbaa4c2e9e56804d8bb22, Chroma.__init__): img_in, txt_in,
#   distilled_guidance_layer (Approximator), double_blocks (DoubleStreamBlock), single_blocks (SingleStreamBlock),
#   final_layer (LastLayer);
# - comfy/ldm/chroma/layers.py (08b7cc750681be5abaf31cfa0f7003eb6fc8cf56): DoubleStreamBlock has img_attn.qkv
#   (q | k | v rows, its forward's view(..., 3, heads, -1)), img_attn.proj, img_mlp.0 / img_mlp.2 and the same
#   txt_ Linears, no img_mod / txt_mod (the modulation is the approximator's); SingleStreamBlock has linear1
#   (q | k | v | mlp rows, `torch.split(..., [3 * hidden_size, mlp_hidden_dim])`) and linear2, no modulation;
# - comfy/lora.py model_lora_keys_unet (41444b5236c613ee5ff7d09aa620f94b702f30eb; tests/test_comfyui_keys.py): for
#   every `diffusion_model.<k>.weight`, `lora_unet_<k, "." -> "_">` maps to it (and Chroma, a Flux subclass, also
#   gets the Flux branch's `transformer.<diffusers name>` keys).
# {diffusers Linear in a block: (ComfyUI Linear, slot, slots)}; diffusers' names from FLUX.1's (the same blocks)
_DOUBLE = {"attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
           "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
           "attn.add_v_proj": ("txt_attn.qkv", 2), "attn.to_out.0": ("img_attn.proj", 0),
           "attn.to_add_out": ("txt_attn.proj", 0), "ff.net.0.proj": ("img_mlp.0", 0), "ff.net.2": ("img_mlp.2", 0),
           "ff_context.net.0.proj": ("txt_mlp.0", 0), "ff_context.net.2": ("txt_mlp.2", 0)}
_SINGLE = {"attn.to_q": ("linear1", 0), "attn.to_k": ("linear1", 1), "attn.to_v": ("linear1", 2),
           "proj_mlp": ("linear1", 3), "proj_out": ("linear2", 0)}


def _comfy_chroma(den):
    """({ComfyUI module: (out, in)}, {diffusers Linear: (ComfyUI module, its rows)}) of the blocks' Linears."""
    keys, rows, offsets = {}, {}, {}
    for n, m in den.named_modules():
        hit = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", n)
        table = _DOUBLE if hit and hit[1] == "transformer_blocks" else _SINGLE
        if not (hit and hit[3] in table and isinstance(m, torch.nn.Linear)):
            continue
        name, slot = table[hit[3]]
        key = f"{'double' if table is _DOUBLE else 'single'}_blocks.{hit[2]}.{name}"
        offsets[(key, slot)] = m.out_features
        keys[key] = (keys.get(key, (0, m.in_features))[0] + m.out_features, m.in_features)
    for n, m in den.named_modules():  # rows: the slots before this one
        hit = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", n)
        table = _DOUBLE if hit and hit[1] == "transformer_blocks" else _SINGLE
        if hit and hit[3] in table and isinstance(m, torch.nn.Linear):
            name, slot = table[hit[3]]
            key = f"{'double' if table is _DOUBLE else 'single'}_blocks.{hit[2]}.{name}"
            start = sum(offsets[(key, s)] for s in range(slot))
            rows[n] = (key, slice(start, start + m.out_features))
    return keys, rows


def test_kohya_file_is_the_comfyui_file_and_comfyui_merges_it_to_the_peft_delta(adapter):
    from lora_fixtures import random_lora
    from support import REL, comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya

    den = adapter.load_denoiser()
    keys, rows = _comfy_chroma(den)
    sd, _ = random_lora(den, adapter.default_lora_targets(), 4, 8)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert len(modules) == 17 and modules == set(rows)  # every trained Linear is in one of ComfyUI's
    assert comfyui_loads_kohya("chroma")  # no ComfyUI file apart
    file = to_kohya("chroma", sd, 4, 8)
    merged = comfyui_merge("chroma", file, keys)  # fails on a key ComfyUI leaves unread or a wrong shape
    assert set(merged) == set(keys)
    for m in modules:
        key, sl = rows[m]
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[key][sl] - want).abs().max() <= REL * want.abs().max(), m
