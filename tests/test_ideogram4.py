"""Ideogram 4 LoRAs (`model=tiny_ideogram4`, tasks/models/ideogram4.py and tiny_ideogram4.py): the tiny Ideogram4Pipeline
is built offline, deterministically, with Ideogram 4's geometry (VAE /8 then 2x2 patches, 13 Qwen3-VL taps, two
transformers).

- Latents: packed and normalised exactly as the pipeline un-does them before vae.decode.
- Text: the bytes of the pipeline's encode_prompt (left-padded window, the caption's mask).
- One training step with a peft LoRA on the default targets: finite loss, non-zero LoRA gradients; the text window
  cut to the batch's longest caption predicts what the pipeline's whole window does.
- `sample` from cached text is the pipeline's own image from the prompt string, with and without CFG.
- The saved LoRA loads with Ideogram4Pipeline.load_lora_weights into `transformer` alone.
- The whole DAG through the CLI on the demo images. The kohya file is musubi-tuner's names, which ComfyUI's
  Ideogram 4 model maps completely (q/k/v fused); the LyCORIS file is in those names too.
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

from tasks.config import ConfigError
from tasks.config_schema import TrainConfig
from tasks.models.ideogram4 import Ideogram4Adapter, packed_ids
from tasks.models.tiny.tiny_ideogram4 import TAPS, build_tiny_ideogram4

REPO = Path(__file__).resolve().parents[1]
L = 32  # tiny_ideogram4.yaml's max_sequence_length
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTIONS = ["a red circle", "a green square on a blue background", ""]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_ideogram4(tmp_path_factory.mktemp("tiny_ideogram4"))


@pytest.fixture(scope="module")
def adapter(model):
    return Ideogram4Adapter(model, "float32", L)


@pytest.fixture(scope="module")
def texts(adapter):
    return adapter.encode_text(adapter.load_text_encoders(), CAPTIONS)


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _pipe(model):
    from diffusers import Ideogram4Pipeline

    pipe = Ideogram4Pipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _lora(adapter, **kw):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets(), **kw))
    return denoiser


def _batch(texts, *idx):
    return {k: torch.stack([texts[i][k] for i in idx]) for k in texts[0]}


def test_build_is_deterministic_and_has_ideogram4_geometry(model, tmp_path):
    again = build_tiny_ideogram4(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = _pipe(model)
    assert (pipe.vae_scale_factor, pipe.patch_size, Ideogram4Adapter.size_multiple) == (8, 2, 16)
    t, u = pipe.transformer, pipe.unconditional_transformer
    same = [k for k in t.config if k != "_name_or_path" and t.config[k] == u.config[k]]
    assert len(same) == len(t.config) - 1 and not torch.equal(t.input_proj.weight, u.input_proj.weight)  # two models
    assert t.config.in_channels == 4 * pipe.vae.config.latent_channels == pipe.vae.bn.num_features
    te = pipe.text_encoder
    assert type(te).__name__ == "Qwen3VLModel" and te.config.text_config.num_hidden_layers == 36  # taps reach 35
    assert t.config.llm_features_dim == TAPS * te.config.text_config.hidden_size


def test_latents_are_what_the_pipeline_unpacks_before_decoding(adapter):
    vae = adapter.load_vae()
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = adapter.encode_latents(vae, pixels)
    assert z.shape == (1, 16, 2, 3)
    # the pipeline's step 9 on the packed tokens: times the bn std, plus the mean, then unpatched
    tokens = z.permute(0, 2, 3, 1).reshape(1, 6, 16)
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, 1, -1)
    x = tokens * std + vae.bn.running_mean.view(1, 1, -1)
    x = x.view(1, 2, 3, 2, 2, 4).permute(0, 5, 1, 3, 2, 4).reshape(1, 4, 4, 6)
    torch.testing.assert_close(x, vae.encode(pixels).latent_dist.mode())  # one divide and one multiply apart


def test_text_is_what_encode_prompt_returns(adapter, texts):
    from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR

    pipe = _pipe(adapter.model_dir)
    with torch.no_grad():
        feats, _, _, indicator = pipe.encode_prompt(CAPTIONS, 0, 0, L, "cpu")
    for i, d in enumerate(texts):  # the same call: the same bytes
        assert list(d) == ["prompt_embeds", "attention_mask"] and d["prompt_embeds"].shape == (L, TAPS * 16)
        assert torch.equal(d["prompt_embeds"], feats[i])
        assert torch.equal(d["attention_mask"], (indicator[i] == LLM_TOKEN_INDICATOR).long())
        n = int(d["attention_mask"].sum())  # left padding: the caption is the window's last n tokens, zeros before
        assert d["attention_mask"][L - n:].all() and not d["prompt_embeds"][:L - n].any()
    assert int(texts[2]["attention_mask"].sum()) > 0  # "" is the chat template's tokens
    with pytest.raises(ConfigError, match="max_sequence_length"):
        adapter.encode_text(adapter.load_text_encoders(), ["a red circle " * 20])  # the pipeline refuses it too


def test_one_training_step(adapter, texts):
    denoiser = _lora(adapter)
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    assert len(modules) == 2 * 7  # per block: q, k, v, out, w1, w2, w3
    latents = torch.randn(2, 16, 2, 3, generator=torch.Generator().manual_seed(1))
    loss = adapter.training_loss(denoiser, latents, _batch(texts, 0, 1), TRAIN, adapter.load_train_scheduler(),
                                 _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in lora.values() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_the_cut_text_window_predicts_what_the_whole_window_does(adapter, texts):
    """training_loss feeds the last k tokens of the window (the batch's longest caption), its ids made without the
    pipeline's Python loop (packed_ids: equal to _prepare_ids); the pipeline feeds all L. The padding is its own
    attention segment: the image tokens' prediction is the same, to rounding."""
    from tolerance import assert_close, sums

    t, P = adapter.load_denoiser(), adapter.pipeline_cls
    text = _batch(texts, 0, 1)
    tokens = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))

    lengths = text["attention_mask"].sum(dim=1).tolist()
    for window in (L, 20):  # training's vectorised ids are the pipeline's, on any window holding the captions
        ours, pipes = packed_ids(text["attention_mask"][:, -window:], 2, 3), P._prepare_ids(lengths, 2, 3, window, "cpu")
        assert all(torch.equal(a, b) for a, b in zip(ours, pipes))

    def predict(window):
        ids = packed_ids(text["attention_mask"][:, -window:], 2, 3)
        feats = torch.cat([text["prompt_embeds"][:, -window:], torch.zeros(2, 6, TAPS * 16)], dim=1)
        with torch.no_grad():
            out = t(hidden_states=torch.cat([torch.zeros(2, window, 16), tokens], dim=1),
                    timestep=torch.tensor([0.3, 0.8]), encoder_hidden_states=feats, position_ids=ids[0],
                    segment_ids=ids[1], indicator=ids[2], return_dict=False)[0]
        return out[:, window:]

    k = int(text["attention_mask"].sum(dim=1).max())
    assert k < L
    assert_close(predict(k), predict(L), **sums(t), what="image tokens, cut window vs whole window")


@pytest.mark.parametrize("guidance", [3.0, 1.0])  # CFG against the unconditional model, and the conditional alone
def test_sample_from_cached_text_is_the_pipelines_image(adapter, texts, model, guidance):
    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None and pipe.unconditional_transformer is not None
    image = adapter.sample(pipe, texts[0], None, texts[2], 48, 32, 2, guidance, 1.0, seed=0)
    assert image.size == (48, 32)
    ref = _pipe(model)(prompt=CAPTIONS[0], width=48, height=32, num_inference_steps=2, guidance_scale=guidance,
                       guidance_schedule=None, max_sequence_length=L, generator=torch.Generator().manual_seed(0))
    assert np.array_equal(np.asarray(image), np.asarray(ref.images[0]))  # the same computation: the same bytes
    # the unconditional branch reads no text: a negative prompt changes nothing
    again = adapter.sample(pipe, texts[0], texts[1], texts[2], 48, 32, 2, guidance, 1.0, seed=0)
    assert np.array_equal(np.asarray(image), np.asarray(again))


def test_saved_lora_loads_with_load_lora_weights_into_the_conditional_model(adapter, texts, model, tmp_path):
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = _lora(adapter, lora_alpha=8, init_lora_weights="gaussian")
    optimizer = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)
    latents = torch.randn(1, 16, 2, 2, generator=torch.Generator().manual_seed(2))
    adapter.training_loss(denoiser, latents, _batch(texts, 1), TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))

    pipe = _pipe(model)
    P, text = adapter.pipeline_cls, _batch(texts, 1)
    ids = P._prepare_ids(text["attention_mask"].sum(dim=1).tolist(), 2, 2, L, "cpu")
    inputs = dict(hidden_states=torch.cat([torch.zeros(1, L, 16), torch.randn(1, 4, 16)], dim=1),
                  timestep=torch.tensor([0.4]), encoder_hidden_states=torch.cat(
                      [text["prompt_embeds"], torch.zeros(1, 4, TAPS * 16)], dim=1),
                  position_ids=ids[0], segment_ids=ids[1], indicator=ids[2], return_dict=False)
    uncond = {k: v.clone() for k, v in pipe.unconditional_transformer.state_dict().items()}
    with torch.no_grad():
        before = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(str(file))  # what load_sampler does
        assert sum("lora_A" in n for n in pipe.transformer.state_dict()) == 14
        after = pipe.transformer(**inputs)[0]
        trained = denoiser(**inputs)[0]
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, trained)  # the file's alpha / rank scale (2.0) is the trained one
    un = pipe.unconditional_transformer.state_dict()  # the unconditional model stays the base
    assert un.keys() == uncond.keys() and all(torch.equal(un[k], v) for k, v in uncond.items())


def test_whole_dag_through_the_cli_on_the_demo_images(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> report through `python -m flows.train
    model=tiny_ideogram4` on the demo images at 32 px."""
    from conftest import cli_env

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "model=tiny_ideogram4", "train.max_steps=2", "sample.steps=2",
         "data.resolution=32", "train.log_with=none", f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=cli_env(tmp_path / "prefect-home"), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert all(report["nodes"][n]["status"] == "ran" for n in ("cache_latents", "cache_text", "train", "sample"))
    samples = report["artifacts"]["samples"]
    assert samples and all(s.endswith(".png") and Path(s).is_file() for s in samples)
    files = report["artifacts"]["lora_files"]
    assert set(files) == {"diffusers", "kohya", "comfyui"} and files["comfyui"] == files["kohya"]
    assert all(Path(f).is_file() for f in files.values())


# ComfyUI's Ideogram 4 model (comfyanonymous/ComfyUI at ca686606aed606b8ef6ca90c0580f8f0e2dc3a66,
# comfy/ldm/ideogram4/model.py): Ideogram4Attention has `qkv` (hidden -> 3 hidden; forward: view(B, L, 3, heads,
# head_dim), so rows [q; k; v]) and `o`; Ideogram4TransformerBlock has `attention`, `feed_forward` (Lumina2's
# FeedForward: w1, w2, w3) and `adaln_modulation` inside `layers`; the embedders (input_proj, llm_cond_proj,
# t_embedding.mlp_in/out, adaln_proj) and final_layer.linear / .adaln_modulation keep diffusers' names. Its LoRA
# names: comfy/lora.py `model_lora_keys_unet` (at 41444b5236c613ee5ff7d09aa620f94b702f30eb): for every
# `diffusion_model.<k>.weight`, `lora_unet_<k, "." -> "_">` (tests/support.py comfyui_merge restates it).
# musubi-tuner (kohya-ss/musubi-tuner at 3b455c45fbbb70d9332bb8d8454a7f4b8938d266,
# src/musubi_tuner/networks/lora_ideogram4.py, lines 12-16 and 42-52): networks.lora.create_network over every
# Ideogram4TransformerBlock, prefix "lora_unet", include patterns `.*attention\.(qkv|o)` and
# `.*feed_forward\.w[123]` (everything else excluded): the same names for the default targets.
def _comfy_keys(den):
    """({ComfyUI module key: (out, in)}, {diffusers Linear: (ComfyUI module key, its rows)}) of `den`'s Linears."""
    keys, rows = {}, {}
    for n, m in den.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        hit = re.fullmatch(r"(layers\.\d+\.attention)\.to_([qkv])", n)
        key = f"{hit[1]}.qkv" if hit else n.replace("attention.to_out.0", "attention.o")
        slot = "qkv".index(hit[2]) if hit else 0
        out, _ = keys.get(key, (0, m.in_features))
        rows[n] = (key, slice(slot * m.out_features, (slot + 1) * m.out_features))
        keys[key] = (out + m.out_features, m.in_features)
    return keys, rows


def _random_lora(adapter, targets):
    from lora_fixtures import random_lora

    den = adapter.load_denoiser()
    keys, rows = _comfy_keys(den)
    sd, _ = random_lora(den, targets, 4, 8)
    return keys, rows, sd, den


def test_kohya_file_is_mapped_completely_by_comfyui_and_is_musubi_tuners(adapter):
    """Every key of the kohya (= ComfyUI) file maps by ComfyUI's generic rule to a weight of its Ideogram 4 model of
    the right shape and merges to the PEFT LoRA's delta, q/k/v as row blocks of the fused qkv (exact up to float32
    rounding of one product, support.REL); every Linear (the embedders and modulations too) has a name; the default
    targets' names are exactly musubi-tuner's."""
    from support import REL, comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya

    linears = [n for n, m in adapter.load_denoiser().named_modules() if isinstance(m, torch.nn.Linear)]
    keys, rows, sd, den = _random_lora(adapter, linears)  # every Linear of the model
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert modules == set(rows)
    merged = comfyui_merge("ideogram4", to_kohya("ideogram4", sd, 4, 8), keys)
    assert set(merged) == set(keys) and "layers.0.attention.qkv" in merged
    for m in modules:
        key, sl = rows[m]
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[key][sl] - want).abs().max() <= REL * want.abs().max(), m
    assert comfyui_loads_kohya("ideogram4")

    _, _, sd, den = _random_lora(adapter, adapter.default_lora_targets())
    musubi = {f"lora_unet.layers.{i}.{m}".replace(".", "_") for i in range(den.config.num_layers)
              for m in ("attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    assert {k.split(".")[0] for k in to_kohya("ideogram4", sd, 4, 8)} == musubi


@pytest.mark.parametrize("network", ["loha", "lokr"])
def test_lycoris_file_is_mapped_completely_by_comfyui_with_the_trained_delta(adapter, network):
    """The LyCORIS file is in ComfyUI's module names (lycoris_names="comfyui": ComfyUI registers no `lycoris_` name
    for Ideogram 4, only the generic rule), each module's LoHa/LoKr merging, as ComfyUI computes it
    (tests/comfyui_video.py), to the trained delta, q/k/v fused into qkv (LoKr: w2 shared, as training ties it)."""
    from comfyui_video import lycoris_merge
    from peft import get_peft_model_state_dict
    from support import lycoris_magnitude as _magnitude
    from tolerance import rounding

    from tasks.models.lora_variants import lycoris
    from tasks.training.export_lycoris import fused_groups, to_lycoris

    rank, alpha = 4, 6.0
    den = adapter.load_denoiser()
    keys, rows = _comfy_keys(den)
    den.add_adapter(lycoris.make_config(network, rank, alpha, adapter.default_lora_targets()))
    layers = {n: m for n, m in den.named_modules() if hasattr(m, "get_delta_weight")}
    if network == "lokr":  # as training ties them (tasks/training/train_setup.py)
        lycoris.share_w2(den, fused_groups("ideogram4", layers))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # as training leaves it: every factor non-zero (peft starts one at zero)
        for p in (p for p in den.parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in den.peft_config["default"].to_dict().items()}
    sd = get_peft_model_state_dict(den)
    file = to_lycoris(sd, config, "ideogram4")
    assert file and all(k.startswith("lora_unet_layers_") for k in file)
    merged = lycoris_merge(file, keys)  # every key read, every delta of its module's shape
    assert {rows[n][0] for n in layers} == set(merged) and "layers.1.attention.qkv" in merged
    parts = lycoris.modules_of(sd, network)
    for name, layer in layers.items():
        want = layer.get_delta_weight("default").double()
        key, sl = rows[name]
        bound = rounding(3 * rank, stages=3, magnitude=alpha / rank * _magnitude(parts[name]))
        assert (merged[key][sl] - want).abs().max().item() <= bound, name
        assert want.abs().max() > 0


def test_lora_memorises_its_image(tmp_path):
    """bench/learns.py's check for `tiny_ideogram4`: one image memorised, rendered by Ideogram4Pipeline with the
    diffusers file (load_lora_weights) and with the kohya file merged by ComfyUI's rule, each within the bound."""
    from learning import learns_within_bound

    _, _, r = learns_within_bound("tiny_ideogram4", tmp_path)
    assert r["loaders"]["kohya"] == "merge"
