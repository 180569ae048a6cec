"""Kandinsky 5.0 text-to-video LoRAs (`model=tiny_kandinsky5`, tasks/models/kandinsky5.py and tiny_kandinsky5.py): the
tiny Kandinsky5T2VPipeline is built offline, deterministically, with HunyuanVideo's VAE geometry (1 + 4k frames, /8
in space) and the pipeline's 128-token prompt-template prefix.

- Latents: a 9-frame clip -> 3 latent frames, an image -> 1, scaled as the pipeline un-scales them before decoding.
- Text: each caption's tokens are the pipeline's encode_prompt bytes for it (Qwen window + mask, CLIP pooled).
- Training: one step with a peft LoRA on the default (musubi-tuner's) targets: finite loss, non-zero LoRA
  gradients; a batch of unequal captions predicts what each item alone predicts.
- `sample` from cached text is the pipeline's own video from the prompt strings, with CFG and without.
- The saved LoRA loads with Kandinsky5T2VPipeline.load_lora_weights and gives the trained model's output.
- The whole DAG through the CLI on the demo clips. The kohya file is in musubi-tuner's names, which ComfyUI's generic
  rule maps onto its Kandinsky5 model with the trained delta (sources cited below).
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
from tasks.data.clips import Video
from tasks.models.kandinsky5 import Kandinsky5Adapter
from tasks.models.tiny.tiny_kandinsky5 import build_tiny_kandinsky5

REPO = Path(__file__).resolve().parents[1]
L = 32  # Qwen2.5-VL tokens (tiny_kandinsky5.yaml's max_sequence_length)
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTIONS = ["a red box moving right", "a green square on a yellow background, flat colors", "", "blurry"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_kandinsky5(tmp_path_factory.mktemp("tiny_k5"))


@pytest.fixture(scope="module")
def adapter(model):
    return Kandinsky5Adapter(model, "float32", L)


@pytest.fixture(scope="module")
def encoders(adapter):
    return adapter.load_text_encoders()


@pytest.fixture(scope="module")
def texts(adapter, encoders):
    return adapter.encode_text(encoders, CAPTIONS)


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _pipe(model):
    from diffusers import Kandinsky5T2VPipeline

    pipe = Kandinsky5T2VPipeline.from_pretrained(model, use_safetensors=True)
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


def test_build_is_deterministic_and_has_kandinsky5_geometry(model, tmp_path):
    again = build_tiny_kandinsky5(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = _pipe(model)
    assert (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial) == (4, 8)
    assert (Kandinsky5Adapter.clips.frame_step, Kandinsky5Adapter.size_multiple) == (4, 16)
    config = pipe.transformer.config
    assert config.visual_cond and tuple(config.patch_size) == (1, 2, 2)  # noisy | condition | mask channels
    assert [type(pipe.text_encoder).__name__, type(pipe.text_encoder_2).__name__] == [
        "Qwen2_5_VLForConditionalGeneration", "CLIPTextModel"]
    # the pipeline drops the template's first 128 tokens: with the tiny tokenizer they are exactly the template
    ids = pipe.tokenizer(pipe.prompt_template.format("a red box"))["input_ids"]
    start = pipe.prompt_template_encode_start_idx
    assert start == 128 and pipe.tokenizer.convert_ids_to_tokens(ids[start - 3:start + 1]) == [
        "<|im_start|>", "user", "Ċ", "a"]


def test_clip_and_image_latents(adapter):
    vae = adapter.load_vae()
    clip = torch.rand(1, 3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = adapter.encode_latents(vae, clip)
    assert z.shape == (1, 4, 3, 4, 6)  # 1 + (9 - 1) / 4 latent frames, /8 in space
    image = adapter.encode_latents(vae, clip[:, :, 0])  # an image: a one-frame video
    assert image.shape == (1, 4, 1, 4, 6)
    raw = vae.encode(clip).latent_dist.mode()
    torch.testing.assert_close(z / vae.config.scaling_factor, raw)  # __call__'s `latents / scaling_factor`
    assert vae.config.scaling_factor != 1.0 and not torch.allclose(z, raw)


def test_text_is_what_encode_prompt_returns(encoders, texts):
    for text, d in zip(CAPTIONS, texts):
        assert list(d) == ["prompt_embeds_qwen", "attention_mask", "prompt_embeds_clip"]
        assert d["prompt_embeds_qwen"].shape == (L, 32) and d["prompt_embeds_clip"].shape == (32,)
        with torch.no_grad():  # the pipeline's own call for this prompt, as __call__ makes it
            qwen, clip, cu = encoders.encode_prompt(text, max_sequence_length=L, device="cpu", dtype=torch.float32)
        n = int(cu[-1])
        assert n > 0 and d["attention_mask"].tolist() == [1] * n + [0] * (L - n)
        assert torch.equal(d["prompt_embeds_qwen"][:n], qwen[0]) and torch.equal(d["prompt_embeds_clip"], clip[0])
        assert not d["prompt_embeds_qwen"][n:].any()  # zeros past the caption
    assert len({int(d["attention_mask"].sum()) for d in texts}) > 1  # captions of their own lengths


def test_one_training_step(adapter, texts):
    denoiser = _lora(adapter)
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    # per text block: self-attention q/k/v/out + feed-forward in/out; per visual block the cross-attention's four too
    assert len(modules) == 1 * 6 + 2 * 10 and not any("modulation" in m for m in modules)
    latents = torch.randn(2, 4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    loss = adapter.training_loss(denoiser, latents, _batch(texts, 0, 1), TRAIN, adapter.load_train_scheduler(), _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in lora.values() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_a_batch_of_unequal_captions_predicts_each_items_own(adapter, texts):
    transformer = adapter.load_denoiser()
    x = adapter.visual_input(transformer, torch.randn(2, 2, 4, 4, 4, generator=torch.Generator().manual_seed(4)), None)
    assert x.shape[-1] == 2 * 4 + 1  # zero condition latents and mask (t2v, as prepare_latents)
    t = torch.tensor([500.0, 120.0])
    with torch.no_grad():
        both = adapter.predict(transformer, x, _batch(texts, 0, 1), t)
        alone = [adapter.predict(transformer, x[i:i + 1], _batch(texts, i), t[i:i + 1]) for i in (0, 1)]
    assert both.shape == (2, 2, 4, 4, 4)
    assert torch.equal(both, torch.cat(alone))  # one call per item: no padding token ever attended


def _frames(video):
    return np.stack([np.asarray(f) for f in video.frames]).astype(np.int16)


@pytest.mark.parametrize("negative,guidance", [(None, 5.0), (3, 5.0), (None, 1.0)], ids=["cfg-empty", "cfg-n", "no-cfg"])
def test_sample_from_cached_text_is_the_pipelines_video(adapter, texts, model, negative, guidance):
    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None and pipe.text_encoder_2 is None
    neg = texts[negative] if negative is not None else None
    video = adapter.sample(pipe, texts[0], neg, texts[2], 48, 32, 2, guidance, 1.0, seed=0, frames=5, fps=12.0)
    assert isinstance(video, Video) and len(video.frames) == 5 and video.fps == 12.0
    assert {f.size for f in video.frames} == {(48, 32)}
    # the pipeline from the prompt strings (its own text encoders): the negative is the prompt's --n, else ""
    ref = _pipe(model)(prompt=CAPTIONS[0], negative_prompt=CAPTIONS[negative] if negative is not None else "",
                       width=48, height=32, num_frames=5, num_inference_steps=2, guidance_scale=guidance,
                       max_sequence_length=L, generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    ref = (np.clip(ref, 0, 1) * 255).round().astype(np.int16)
    assert np.array_equal(_frames(video), ref)  # each caption encoded alone, as the pipeline does: the same bytes


def test_saved_lora_loads_with_load_lora_weights_and_gives_the_trained_output(adapter, texts, model, tmp_path):
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = _lora(adapter, lora_alpha=8, init_lora_weights="gaussian")
    optimizer = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)
    text = _batch(texts, 1)
    latents = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))
    assert file.is_file()

    pipe = _pipe(model)
    x = adapter.visual_input(pipe.transformer, torch.randn(1, 2, 4, 4, 4, generator=torch.Generator().manual_seed(3)), text)
    t = torch.tensor([500.0])
    with torch.no_grad():
        before = adapter.predict(pipe.transformer, x, text, t)
        pipe.load_lora_weights(str(file))  # KandinskyLoraLoaderMixin, as load_sampler loads it
        assert sum("lora_A" in n for n in pipe.transformer.state_dict()) == 26
        after = adapter.predict(pipe.transformer, x, text, t)
        trained = adapter.predict(denoiser, x, text, t)
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, trained)  # the file's alpha / rank scale (2.0) is the trained one


def test_whole_dag_through_the_cli_on_the_demo_clips(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> report through `python -m flows.train
    model=tiny_kandinsky5` on the demo clips (4 clips of 17 frames at 16 fps, one still image) at 32 px."""
    from conftest import cli_env

    run_dir = tmp_path / "run"
    env = cli_env(tmp_path / "prefect-home")
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "model=tiny_kandinsky5", "data=demo_clips", "data.resolution=32",
         "train.max_steps=2", "sample.steps=2", f"sample.prompts_file={REPO / 'data' / 'demo_clips_prompts.txt'}",
         "train.log_with=none", f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert all(report["nodes"][n]["status"] == "ran" for n in ("cache_latents", "cache_text", "train", "sample"))
    samples = report["artifacts"]["samples"]
    assert len(samples) == 2 and all(s.endswith(".mp4") and Path(s).is_file() for s in samples)
    files = report["artifacts"]["lora_files"]
    assert {"diffusers", "kohya"} <= set(files) and all(Path(f).is_file() for f in files.values())
    assert files.get("comfyui", files["kohya"]) == files["kohya"]  # the kohya file is the ComfyUI file


# ComfyUI's Kandinsky 5 model (comfyanonymous/ComfyUI at aca55a133f34fe213ce4caa27751064410b0720a,
# comfy/ldm/kandinsky5/model.py, line numbers counted in the stored file): SelfAttention (about lines 98-145:
# to_query, to_key, to_value, query_norm, key_norm, out_layer), CrossAttention(SelfAttention) (148-158),
# FeedForward in_layer / out_layer (161-184), TransformerEncoderBlock: text_modulation, self_attention,
# feed_forward (213-236), TransformerDecoderBlock: visual_modulation, self_attention, cross_attention, feed_forward
# (239-272), held by Kandinsky5 (275 on) in `text_transformer_blocks` / `visual_transformer_blocks`: diffusers' module
# names, one Linear each (no fused q/k/v). comfy/lora.py `model_lora_keys_unet` (ComfyUI at
# 41444b5236c613ee5ff7d09aa620f94b702f30eb, its first loop): every `diffusion_model.<k>.weight` of the model is
# `lora_unet_<k, "." -> "_">` (and `<k>` bare); no Kandinsky branch and no `lycoris_` name for it (the LyCORIS file
# takes the generic names: KohyaLayout lycoris_names="comfyui"). musubi-tuner (kohya-ss/musubi-tuner at
# 30c658c4f4b0bf05038b3346eff9670259b10fc7), src/musubi_tuner/networks/lora_kandinsky.py: line 16
# (TransformerEncoderBlock, TransformerDecoderBlock), lines 19-33 (the include patterns: self_attention /
# cross_attention .to_query/.to_key/.to_value/.out_layer, feed_forward .in_layer/.out_layer), lines 50-61
# (`.*modulation.*` excluded, networks.lora.create_network with prefix "lora_unet"); its DiT
# (src/musubi_tuner/kandinsky5/models/dit.py lines 33-70, nn.py lines 196-470) has the same module names.
MUSUBI = (r"(text|visual)_transformer_blocks\.\d+\.((self_attention|cross_attention)\.(to_query|to_key|to_value"
          r"|out_layer)|feed_forward\.(in_layer|out_layer))")


def test_kohya_file_is_musubi_tuners_and_comfyui_maps_it_with_the_trained_delta(adapter):
    from lora_fixtures import random_lora
    from support import REL, comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya, to_comfyui

    den = adapter.load_denoiser()
    keys = {n: tuple(m.weight.shape) for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}
    sd, _ = random_lora(den, adapter.default_lora_targets(), 4, 8)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert modules == {n for n in keys if re.fullmatch(MUSUBI, n)}  # exactly musubi-tuner's modules
    file = to_kohya("kandinsky5", sd, 4, 8)
    assert {k.split(".")[0] for k in file} == {"lora_unet_" + m.replace(".", "_") for m in modules}
    merged = comfyui_merge("kandinsky5", file, keys)  # every key read, each delta the module's shape
    assert set(merged) == modules
    for m in modules:
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[m] - want).abs().max() <= REL * want.abs().max(), m
    assert comfyui_loads_kohya("kandinsky5")
    assert set(to_comfyui("kandinsky5", sd, 4, 8)) == set(file)


def test_lora_memorises_its_clip(tmp_path):
    """bench/learns.py's check for `tiny_kandinsky5`: one clip memorised, rendered by Kandinsky5T2VPipeline with the
    diffusers file (load_lora_weights) and with the kohya file merged by ComfyUI's rule, each within the bound."""
    from learning import learns_within_bound

    _, _, r = learns_within_bound("tiny_kandinsky5", tmp_path)
    assert r["loaders"]["kohya"] == "merge"


@pytest.mark.parametrize("network", ["loha", "lokr"])
def test_lycoris_file_is_mapped_completely_by_comfyui_with_the_trained_delta(adapter, network):
    """LoHa / LoKr (train.network): the LyCORIS file in the generic `lora_unet_<model key>` names (ComfyUI has no
    `lycoris_` name for Kandinsky 5, see above), every key read by ComfyUI's LoHa / LoKr rule (tests/comfyui_video.py
    restates it) with the trained delta."""
    from comfyui_video import lycoris_merge
    from peft.utils import get_peft_model_state_dict
    from support import lycoris_magnitude
    from tolerance import rounding

    from tasks.models.lora_variants import lycoris
    from tasks.training.export_lycoris import to_lycoris

    rank, alpha = 4, 6.0
    den = adapter.load_denoiser()
    keys = {n: tuple(m.weight.shape) for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}
    den.add_adapter(lycoris.make_config(network, rank, alpha, adapter.default_lora_targets()))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # every factor non-zero, as training leaves them (peft starts one at zero)
        for p in den.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in den.peft_config["default"].to_dict().items()}
    sd = get_peft_model_state_dict(den)
    file = to_lycoris(sd, config, "kandinsky5")
    assert file and all(k.startswith("lora_unet_") for k in file)
    merged = lycoris_merge(file, keys)
    layers = {n: m for n, m in den.named_modules() if hasattr(m, "get_delta_weight")}
    assert set(merged) == set(layers) and all(re.fullmatch(MUSUBI, n) for n in layers)
    parts = lycoris.modules_of(sd, network)
    for name, layer in layers.items():
        want = layer.get_delta_weight("default").double()
        bound = rounding(3 * rank, stages=3, magnitude=alpha / rank * lycoris_magnitude(parts[name]))
        assert (merged[name] - want).abs().max().item() <= bound, name
