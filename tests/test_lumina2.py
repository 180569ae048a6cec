"""Lumina Image 2.0 LoRAs (`model=tiny_lumina2`, tasks/models/lumina2.py and tiny_lumina2.py): the tiny Lumina2Pipeline
is built offline, deterministically, with Lumina 2's geometry (FLUX.1's /8 VAE, 2x2 patches in the transformer, GQA
attention, Gemma 2's width as the caption width).

- Text: what Lumina2Pipeline.encode_prompt returns, byte for byte, for a text as a prompt (after the system prompt)
  and as a negative (as written).
- One training step with a peft LoRA on the default targets: finite loss, non-zero LoRA gradients.
- `sample` from cached text is the pipeline's own image from the prompt strings, with and without CFG / a negative.
- The saved LoRA loads with Lumina2Pipeline.load_lora_weights and gives the trained model's output.
- The whole DAG through the CLI. The kohya file (sd-scripts' names, q/k/v fused) is the ComfyUI file: every key maps
  to a weight of ComfyUI's Lumina 2 model and merges to the PEFT delta.
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
from tasks.models.lumina2 import Lumina2Adapter
from tasks.models.tiny.tiny_lumina2 import build_tiny_lumina2

REPO = Path(__file__).resolve().parents[1]
L = 64  # Gemma tokens (tiny_lumina2.yaml's max_sequence_length)
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTIONS = ["a red box on a blue background", "blurry, flat colors", ""]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_lumina2(tmp_path_factory.mktemp("tiny_lumina2"))


@pytest.fixture(scope="module")
def adapter(model):
    return Lumina2Adapter(model, "float32", L)


@pytest.fixture(scope="module")
def texts(adapter):
    return adapter.encode_text(adapter.load_text_encoders(), CAPTIONS)


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _pipe(model):
    from diffusers import Lumina2Pipeline

    pipe = Lumina2Pipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _lora(adapter, **kw):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets(), **kw))
    return denoiser


def test_build_is_deterministic_and_has_lumina2s_geometry(model, tmp_path):
    again = build_tiny_lumina2(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = _pipe(model)
    t = pipe.transformer
    assert type(t).__name__ == "Lumina2Transformer2DModel" and type(pipe.text_encoder).__name__ == "Gemma2Model"
    assert pipe.vae_scale_factor == 8 and t.config.patch_size == 2 and Lumina2Adapter.size_multiple == 16
    assert t.config.in_channels == pipe.vae.config.latent_channels  # unpacked latents: the transformer patches
    assert t.config.cap_feat_dim == pipe.text_encoder.config.hidden_size
    assert t.config.num_kv_heads < t.config.num_attention_heads  # GQA, as the released 24 / 8 heads
    assert t.layers[0].attn.to_k.out_features < t.layers[0].attn.to_q.out_features
    assert not hasattr(t.context_refiner[0].norm1, "linear")  # the caption refiner has no modulation
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (0.3611, 0.1159)  # FLUX.1's VAE
    assert pipe.tokenizer.padding_side == "right" and pipe.scheduler.config.shift == 6.0


def test_latents_are_what_the_pipeline_decodes(adapter):
    vae = adapter.load_vae()
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = adapter.encode_latents(vae, pixels)
    assert z.shape == (1, 4, 4, 6)
    raw = vae.encode(pixels).latent_dist.mode()  # the pipeline's latents / scaling_factor + shift_factor
    torch.testing.assert_close(z / vae.config.scaling_factor + vae.config.shift_factor, raw)


def test_text_is_encode_prompts_bytes_as_prompt_and_as_negative(model, texts):
    pipe = _pipe(model)
    with torch.no_grad():
        embeds, mask, neg, neg_mask = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=True,
                                                         negative_prompt=CAPTIONS, device="cpu", max_sequence_length=L)
    for i, d in enumerate(texts):
        assert list(d) == ["prompt_embeds", "attention_mask", "negative_prompt_embeds", "negative_attention_mask"]
        assert d["prompt_embeds"].shape == (L, 32) and d["attention_mask"].shape == (L,)
        assert torch.equal(d["prompt_embeds"], embeds[i]) and torch.equal(d["attention_mask"], mask[i])
        assert torch.equal(d["negative_prompt_embeds"], neg[i]) and torch.equal(d["negative_attention_mask"], neg_mask[i])
    # the system prompt leads every prompt, never a negative: "" is <bos> alone as a negative
    assert int(texts[2]["negative_attention_mask"].sum()) == 1 and int(texts[2]["attention_mask"].sum()) > 20
    assert not torch.equal(texts[0]["prompt_embeds"], texts[2]["prompt_embeds"])


def test_one_training_step(adapter, texts):
    denoiser = _lora(adapter)
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    # layers.0 and noise_refiner.0: q, k, v, out, the SwiGLU's 3, the modulation; context_refiner.0: no modulation
    assert len(modules) == 8 + 8 + 7 and not any("norm_out" in m or "embed" in m for m in modules)
    latents = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    text = {k: torch.stack([texts[0][k], texts[1][k]]) for k in texts[0]}  # two caption lengths in one batch
    loss = adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in lora.values() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("guidance,negative", [(4.0, None), (4.0, 1), (1.0, None)])
def test_sample_from_cached_text_is_the_pipelines_image(adapter, texts, model, guidance, negative):
    """CFG (guidance > 1, the pipeline's normalisation on) against the empty prompt or the prompt's negative, and
    without CFG."""
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
    inputs = dict(hidden_states=torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(3)),
                  timestep=torch.tensor([0.5]), encoder_hidden_states=text["prompt_embeds"],
                  encoder_attention_mask=text["attention_mask"], return_dict=False)
    with torch.no_grad():
        before = t(**inputs)[0]
        pipe.load_lora_weights(str(file))  # Lumina2LoraLoaderMixin, the pipeline's own loader
        assert sum("lora_A" in n for n in t.state_dict()) == 23
        after = t(**inputs)[0]
        trained = denoiser(**inputs)[0]
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, trained)  # the file's alpha / rank scale (2.0) is the trained one


def test_whole_dag_through_the_cli_on_the_demo_images(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> report through `python -m flows.train
    model=tiny_lumina2` on the demo images at 32 px, a prompt with a negative among the samples."""
    from conftest import cli_env

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na green square --n blurry\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "model=tiny_lumina2", "train.max_steps=2", "sample.steps=2",
         "data.resolution=32", f"sample.prompts_file={prompts}", "train.log_with=none",
         f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=cli_env(tmp_path / "prefect-home"), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert all(report["nodes"][n]["status"] == "ran" for n in ("cache_latents", "cache_text", "train", "sample"))
    samples = report["artifacts"]["samples"]
    assert len(samples) == 2 and all(s.endswith(".png") and Path(s).is_file() for s in samples)
    files = report["artifacts"]["lora_files"]
    assert {"diffusers", "kohya"} <= set(files) and all(Path(f).is_file() for f in files.values())
    assert files.get("comfyui", files["kohya"]) == files["kohya"]  # the kohya file is the ComfyUI file


# The kohya / ComfyUI names, from the sources (read in this workplace's code index):
# - ComfyUI's Lumina 2 model, comfy/ldm/lumina/model.py (comfyanonymous/ComfyUI at
#   048746f58b9fcaf9fb0c85ed6ae2bf693830119b; "Code from Alpha-VLLM/Lumina-Image-2.0 models/model.py"):
#   JointAttention.qkv, one Linear of (n_heads + 2 n_kv_heads) * head_dim rows split q | k | v in its forward
#   (lines ~40-50, ~95-105), JointAttention.out; FeedForward.w1 / w2 / w3; JointTransformerBlock.adaLN_modulation =
#   Sequential(SiLU, Linear) where modulation (the context refiner has none); NextDiT.layers / noise_refiner /
#   context_refiner, final_layer (linear, adaLN_modulation.1).
# - comfy/lora.py model_lora_keys_unet (41444b5236c613ee5ff7d09aa620f94b702f30eb, and the current one as quoted in
#   index file 51926688842): every `diffusion_model.<k>.weight` -> `lora_unet_<k, "." -> "_">`. Its Lumina2 branch
#   adds `diffusion_model.` / `transformer.` / `lycoris_` / bare names from comfy.utils.z_image_to_diffusers, whose
#   names are Z-Image's diffusers ones (attention.to_q, feed_forward.w1, adaLN_modulation.0) at offsets of equal q/k/v
#   widths (`(0, hidden_size, hidden_size)`): neither Lumina 2's diffusers names nor its GQA rows, so loraflow writes
#   the generic `lora_unet_` names (the kohya file) and its LyCORIS file in them (lycoris_names="comfyui").
# - sd-scripts (kohya-ss/sd-scripts at 1640e533925f5f33a85230d159c33d4c1643096f) networks/lora_lumina.py: LoRANetwork
#   LORA_PREFIX_LUMINA "lora_unet", LUMINA_TARGET_REPLACE_MODULE ["JointTransformerBlock", "FinalLayer"], each Linear
#   child named `lora_unet.<path>` with "." -> "_" (create_modules): `lora_unet_layers_0_attention_qkv`, ...
_BLOCK = {"attn.to_q": ("attention.qkv", 0), "attn.to_k": ("attention.qkv", 1), "attn.to_v": ("attention.qkv", 2),
          "attn.to_out.0": ("attention.out", 0), "feed_forward.linear_1": ("feed_forward.w1", 0),
          "feed_forward.linear_2": ("feed_forward.w2", 0), "feed_forward.linear_3": ("feed_forward.w3", 0),
          "norm1.linear": ("adaLN_modulation.1", 0)}


def _comfy_lumina(den):
    """({ComfyUI module: (out, in)}, {diffusers Linear: (ComfyUI module, its rows)}) of the blocks' Linears."""
    found = []
    for n, m in den.named_modules():
        hit = re.fullmatch(r"((?:layers|noise_refiner|context_refiner)\.\d+)\.(.+)", n)
        if hit and hit[2] in _BLOCK and isinstance(m, torch.nn.Linear):
            name, slot = _BLOCK[hit[2]]
            found.append((n, f"{hit[1]}.{name}", slot, m))
    keys, rows = {}, {}
    for n, key, slot, m in sorted(found, key=lambda f: (f[1], f[2])):  # q, k, v rows in that order
        start = keys.get(key, (0,))[0]
        keys[key] = (start + m.out_features, m.in_features)
        rows[n] = (key, slice(start, start + m.out_features))
    return keys, rows


def test_kohya_file_is_the_comfyui_file_in_sd_scripts_names_and_merges_to_the_peft_delta(adapter):
    from lora_fixtures import random_lora
    from support import REL, comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya, to_comfyui

    den = adapter.load_denoiser()
    keys, rows = _comfy_lumina(den)
    qkv = keys["layers.0.attention.qkv"]
    heads, kv, dim = den.config.num_attention_heads, den.config.num_kv_heads, den.config.hidden_size
    assert qkv == ((heads + 2 * kv) * dim // heads, dim)  # ComfyUI's JointAttention.qkv rows
    sd, _ = random_lora(den, adapter.default_lora_targets(), 4, 8)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert len(modules) == 23 and modules == set(rows)  # every trained Linear is in one of ComfyUI's
    assert comfyui_loads_kohya("lumina2")
    file = to_kohya("lumina2", sd, 4, 8)
    assert to_comfyui("lumina2", sd, 4, 8).keys() == file.keys()
    merged = comfyui_merge("lumina2", file, keys)  # fails on a key ComfyUI leaves unread or a wrong shape
    assert set(merged) == set(keys)
    for m in modules:
        key, sl = rows[m]
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[key][sl] - want).abs().max() <= REL * want.abs().max(), m
    # sd-scripts' names: lora_unet_ + the original module path, dots as underscores
    assert {k.split(".")[0] for k in file} == {"lora_unet_" + k.replace(".", "_") for k in keys}
    assert "lora_unet_layers_0_attention_qkv" in {k.split(".")[0] for k in file}
