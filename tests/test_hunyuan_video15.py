"""HunyuanVideo 1.5 text-to-video LoRAs (`model=tiny_hunyuan_video15`, tasks/models/hunyuan_video15.py and
tiny_hunyuan_video15.py): the tiny HunyuanVideo15Pipeline is built offline, deterministically, with HunyuanVideo
1.5's VAE geometry (1 + 4k frames, /16 in space) and the pipeline's 108-token chat-template prefix.

- Latents: a 9-frame clip -> 3 latent frames, an image -> 1, scaled as the pipeline un-scales them before decoding.
- Text: each caption stored at fixed lengths, what the pipeline's encode_prompt returns (both encoders, masks).
- One training step with a peft LoRA on the default targets: finite loss, non-zero LoRA gradients.
- `sample` from cached text is the pipeline's own video from the prompt string.
- The saved LoRA loads with transformer.load_lora_adapter and gives the trained model's output.
- The whole DAG through the CLI on the demo clips. The kohya file is in musubi-tuner's names (q/k/v apart); the
  ComfyUI file, apart, is mapped completely by ComfyUI's generic rule (q/k/v fused).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.config_schema import TrainConfig
from tasks.data.clips import Video
from tasks.models.hunyuan_video15 import HunyuanVideo15Adapter
from tasks.models.tiny.tiny_hunyuan_video15 import build_tiny_hunyuan_video15

REPO = Path(__file__).resolve().parents[1]
L = 32  # Qwen2.5-VL tokens (tiny_hunyuan_video15.yaml's max_sequence_length); ByT5: min(256, L)
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTIONS = ["a red box moving right", 'a sign that says "HELLO" in the rain', ""]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_hunyuan_video15(tmp_path_factory.mktemp("tiny_hv15"))


@pytest.fixture(scope="module")
def adapter(model):
    return HunyuanVideo15Adapter(model, "float32", L)


@pytest.fixture(scope="module")
def encoders(adapter):
    return adapter.load_text_encoders()


@pytest.fixture(scope="module")
def texts(adapter, encoders):
    return adapter.encode_text(encoders, CAPTIONS)


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _pipe(model):
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _lora(adapter, **kw):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets(), **kw))
    return denoiser


def test_build_is_deterministic_and_has_hunyuan_video15_geometry(model, tmp_path):
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    again = build_tiny_hunyuan_video15(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = _pipe(model)
    assert (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial) == (4, 16)
    assert (HunyuanVideo15Adapter.clips.frame_step, HunyuanVideo15Adapter.size_multiple) == (4, 16)
    assert pipe.transformer.config.in_channels == 2 * pipe.vae.config.latent_channels + 1  # noisy | cond | mask
    assert [type(pipe.text_encoder).__name__, type(pipe.tokenizer_2).__name__] == ["Qwen2_5_VLTextModel",
                                                                                    "ByT5Tokenizer"]
    # the pipeline drops the template's first 108 tokens: with the tiny tokenizer they are exactly the template
    ids = pipe.tokenizer.apply_chat_template(format_text_input(["a red box"], pipe.system_message),
                                             add_generation_prompt=True, tokenize=True, return_dict=True).input_ids
    ids = ids[0] if isinstance(ids[0], list) else ids
    start = pipe.prompt_template_encode_start_idx
    assert start == 108 and pipe.tokenizer.convert_ids_to_tokens(ids[start - 3:start + 1]) == [
        "<|im_start|>", "user", "Ċ", "a"]


def test_clip_and_image_latents(adapter):
    vae = adapter.load_vae()
    clip = torch.rand(1, 3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = adapter.encode_latents(vae, clip)
    assert z.shape == (1, 8, 3, 2, 3)  # 1 + (9 - 1) / 4 latent frames, /16 in space
    image = adapter.encode_latents(vae, clip[:, :, 0])  # an image: a one-frame video
    assert image.shape == (1, 8, 1, 2, 3)
    # the causal VAE encodes the first frame alone: the same sums, possibly in another order (conv3d picks its
    # kernel by shape), so float32's default closeness, not bytes
    torch.testing.assert_close(image[:, :, 0], z[:, :, 0])
    # stored scaled: the pipeline's `latents / scaling_factor` before vae.decode gives back the VAE's own mode
    raw = vae.encode(clip).latent_dist.mode()
    torch.testing.assert_close(z / vae.config.scaling_factor, raw)  # one multiply and one divide apart
    assert vae.config.scaling_factor != 1.0 and not torch.allclose(z, raw)


def test_text_is_what_encode_prompt_returns_at_fixed_lengths(encoders, texts):
    keys = ["prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"]
    for d in texts:  # captions of any length (the empty one too) stack into one batch
        assert list(d) == keys
        assert d["prompt_embeds"].shape == (L, 32) and d["prompt_embeds_mask"].shape == (L,)
        assert d["prompt_embeds_2"].shape == (L, 16) and d["prompt_embeds_mask_2"].shape == (L,)
    assert (encoders.tokenizer_max_length, encoders.tokenizer_2_max_length) == (L, L)
    with torch.no_grad():  # as the pipeline's __call__ and encode_text run it (T5 sums otherwise differ)
        batch = encoders.encode_prompt(CAPTIONS, device="cpu", dtype=torch.float32, batch_size=3)
        alone = encoders.encode_prompt([CAPTIONS[1]], device="cpu", dtype=torch.float32)
    for i, d in enumerate(texts):  # the same call: the same numbers
        assert all(torch.equal(d[k], t[i]) for k, t in zip(keys, batch))
    for k, t in zip(keys, alone):  # one caption alone: the same up to batched matmul's summation order
        torch.testing.assert_close(texts[1][k], t[0])
    # ByT5 reads only quoted text: none in the first caption (zeros, empty mask), "HELLO" in the second
    assert texts[0]["prompt_embeds_mask_2"].sum() == 0 and not texts[0]["prompt_embeds_2"].any()
    assert texts[1]["prompt_embeds_mask_2"].sum() > 0
    assert not torch.equal(texts[0]["prompt_embeds"], texts[2]["prompt_embeds"])


def test_one_training_step(adapter, texts):
    denoiser = _lora(adapter)
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    assert len(modules) == 2 * 12  # per block: 8 attention Linears (both streams), ff and ff_context in and out
    assert all(m.startswith("transformer_blocks.") for m in modules)
    latents = torch.randn(2, 8, 2, 2, 2, generator=torch.Generator().manual_seed(1))
    text = {k: torch.stack([texts[0][k], texts[1][k]]) for k in texts[0]}
    loss = adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in lora.values() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_training_without_the_pipelines_masked_image_tokens_predicts_what_the_pipeline_does(adapter, texts):
    # text-to-video: the pipeline passes 729 zero image tokens, which the transformer masks out as keys; training
    # passes none (adapter.condition). The video tokens' prediction is the same maths: equal to rounding
    from tolerance import assert_close, sums

    transformer = adapter.load_denoiser()
    latents = torch.randn(2, 8, 3, 2, 2, generator=torch.Generator().manual_seed(4))
    text = {k: torch.stack([texts[0][k], texts[1][k]]) for k in texts[0]}  # one with ByT5 glyph text
    cond, image_embeds = adapter.condition(transformer, latents, text)
    assert image_embeds.shape == (2, 0, transformer.config.image_embed_dim)
    common = dict(hidden_states=torch.cat([latents, cond], dim=1), timestep=torch.tensor([500.0, 120.0]),
                  encoder_hidden_states=text["prompt_embeds"], encoder_attention_mask=text["prompt_embeds_mask"],
                  encoder_hidden_states_2=text["prompt_embeds_2"],
                  encoder_attention_mask_2=text["prompt_embeds_mask_2"], return_dict=False)
    with torch.no_grad():
        trained = transformer(image_embeds=image_embeds, **common)[0]
        piped = transformer(image_embeds=torch.zeros(2, 729, transformer.config.image_embed_dim), **common)[0]
    assert_close(trained, piped, **sums(transformer), what="t2v prediction without the masked image tokens")
    assert HunyuanVideo15Adapter.image_tokens == 0  # and the memory estimate counts what training feeds
    from tasks.models.hunyuan_video15_i2v import HunyuanVideo15I2VAdapter

    assert HunyuanVideo15I2VAdapter.image_tokens == 729  # image-to-video attends to the first frame's tokens
    assert (HunyuanVideo15I2VAdapter.activation_geometry(transformer.config, (64, 64), L, 9)[0]
            - HunyuanVideo15Adapter.activation_geometry(transformer.config, (64, 64), L, 9)[0]) == 729


def test_sample_from_cached_text_is_the_pipelines_video(adapter, texts, model):
    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None and pipe.text_encoder_2 is None
    video = adapter.sample(pipe, texts[0], None, texts[2], 48, 32, 2, 6.0, 1.0, seed=0, frames=5, fps=12.0)
    assert isinstance(video, Video) and len(video.frames) == 5 and video.fps == 12.0
    assert {f.size for f in video.frames} == {(48, 32)}
    # the pipeline from the prompt strings (its own text encoders), at this family's text lengths and guidance
    full = adapter.set_text_lengths(_pipe(model))
    full.guider = full.guider.new(guidance_scale=6.0)
    ref = full(prompt=CAPTIONS[0], negative_prompt="", width=48, height=32, num_frames=5, num_inference_steps=2,
               generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    ref = (np.clip(ref, 0, 1) * 255).round().astype(np.int16)
    mine = np.stack([np.asarray(f) for f in video.frames]).astype(np.int16)
    # the cached text was encoded in a batch of three, the pipeline's one caption at a time: float32 sums in
    # another order (test_text_...: equal to assert_close), so at most one rounding step of 8-bit pixels apart
    assert np.abs(mine - ref).max() <= 1


def test_saved_lora_loads_with_load_lora_adapter_and_changes_the_output(adapter, texts, model, tmp_path):
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = _lora(adapter, lora_alpha=8, init_lora_weights="gaussian")
    optimizer = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)
    text = {k: v[None] for k, v in texts[1].items()}
    latents = torch.randn(1, 8, 2, 2, 2, generator=torch.Generator().manual_seed(2))
    adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))
    assert file.is_file()

    t = _pipe(model).transformer
    inputs = dict(hidden_states=torch.randn(1, 17, 2, 2, 2, generator=torch.Generator().manual_seed(3)),
                  image_embeds=torch.zeros(1, 729, t.config.image_embed_dim), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=text["prompt_embeds"], encoder_attention_mask=text["prompt_embeds_mask"],
                  encoder_hidden_states_2=text["prompt_embeds_2"],
                  encoder_attention_mask_2=text["prompt_embeds_mask_2"], return_dict=False)
    with torch.no_grad():
        before = t(**inputs)[0]
        t.load_lora_adapter(str(file), prefix="transformer", use_safetensors=True)  # what load_sampler does
        assert sum("lora_A" in n for n in t.state_dict()) == 24
        after = t(**inputs)[0]
        trained = denoiser(**inputs)[0]
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, trained)  # the file's alpha / rank scale (2.0) is the trained one


def test_whole_dag_through_the_cli_on_the_demo_clips(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> report through `python -m flows.train
    model=tiny_hunyuan_video15` on the demo clips (4 clips of 17 frames at 16 fps, one still image) at 64 px."""
    from conftest import cli_env

    run_dir = tmp_path / "run"
    env = cli_env(tmp_path / "prefect-home")
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "model=tiny_hunyuan_video15", "data=demo_clips", "train.max_steps=2",
         "sample.steps=2", f"sample.prompts_file={REPO / 'data' / 'demo_clips_prompts.txt'}", "train.log_with=none",
         f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["nodes"]["train"]["status"] == "ran"
    samples = report["artifacts"]["samples"]
    assert len(samples) == 2 and all(s.endswith(".mp4") and Path(s).is_file() for s in samples)
    files = report["artifacts"]["lora_files"]
    # ComfyUI's model fuses q/k/v, musubi-tuner's does not: the ComfyUI file is apart from the kohya file
    assert set(files) == {"diffusers", "kohya", "comfyui"} and files["comfyui"] != files["kohya"]
    assert all(Path(f).is_file() for f in files.values())


def _hv15_lora(adapter):
    """The tiny transformer with a random LoRA on the default targets and the modulation Linears (musubi-tuner's
    LoRA wraps those too): ({ComfyUI module: (out, in)}, {diffusers Linear: (ComfyUI module, rows)}, peft state)."""
    from comfyui_video import comfy_keys
    from lora_fixtures import random_lora

    den = adapter.load_denoiser()
    keys, rows = comfy_keys("hunyuan_video15", den)
    targets = adapter.default_lora_targets() + r"|.*transformer_blocks\.\d+\.(norm1|norm1_context)\.linear"
    sd, _ = random_lora(den, targets, 4, 8)
    return keys, rows, sd, den.config.num_layers


def test_comfyui_file_is_mapped_completely_by_comfyui(adapter):
    """Every key of the ComfyUI file is read by ComfyUI's generic `lora_unet_<model key>` rule (tests/
    comfyui_video.py restates it and ComfyUI's HunyuanVideo 1.5 block names) and merges to the PEFT LoRA's delta,
    q/k/v as row blocks of the fused qkv (up block-diagonal, down stacked: exact up to float32 rounding of one
    product, support.REL); the kohya file (musubi-tuner's unfused names) leaves them unread there."""
    from support import REL, comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya, to_comfyui

    keys, rows, sd, _ = _hv15_lora(adapter)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert len(modules) == 2 * 14 and modules == set(rows)  # every trained module is in one of ComfyUI's
    merged = comfyui_merge("hunyuan_video15", to_comfyui("hunyuan_video15", sd, 4, 8), keys)
    assert set(merged) == set(keys) and any(k.endswith(".img_attn.qkv") for k in merged)
    for m in modules:
        key, sl = rows[m]
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[key][sl] - want).abs().max() <= REL * want.abs().max(), m
    assert not comfyui_loads_kohya("hunyuan_video15")
    with pytest.raises(AssertionError, match="lora key not loaded"):
        comfyui_merge("hunyuan_video15", to_kohya("hunyuan_video15", sd, 4, 8), keys)


# musubi-tuner's HunyuanVideo 1.5 LoRA (kohya-ss/musubi-tuner at 30c658c4f4b0bf05038b3346eff9670259b10fc7):
# - src/musubi_tuner/networks/lora_hv_1_5.py, lines 16 and 41-51: networks.lora.create_network over every
#   MMDoubleStreamBlock, prefix "lora_unet", exclude pattern `.*(_in).*` (line 37; no block Linear matches it);
# - src/musubi_tuner/networks/lora.py, lines 578-592: each Linear child of such a block is one LoRA module named
#   `lora_unet.<path from the model>` with "." -> "_"; create_network_from_weights (lines 971-1010) makes modules
#   only for the file's names, so a name no Linear has is never applied;
# - hunyuan_video_1_5/hunyuan_video_1_5_models.py, line 108: the blocks are `double_blocks`;
#   hunyuan_video_1_5_modules.py, lines 597-622 (MMDoubleStreamBlock) and 199-203 (MLP): its Linears.
MUSUBI_LINEARS = ("img_mod.linear", "img_attn_q", "img_attn_k", "img_attn_v", "img_attn_proj", "img_mlp.fc1",
                  "img_mlp.fc2", "txt_mod.linear", "txt_attn_q", "txt_attn_k", "txt_attn_v", "txt_attn_proj",
                  "txt_mlp.fc1", "txt_mlp.fc2")
# The same Linears' diffusers names: scripts/convert_hunyuan_video1_5_to_diffusers.py (tests/comfyui_video.py)
DIFFUSERS_OF = dict(zip(MUSUBI_LINEARS, ("norm1.linear", "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                         "ff.net.0.proj", "ff.net.2", "norm1_context.linear", "attn.add_q_proj",
                                         "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                                         "ff_context.net.0.proj", "ff_context.net.2")))


def test_kohya_file_is_in_musubi_tuners_names(adapter):
    """The kohya file's modules are exactly those musubi-tuner's networks.lora_hv_1_5 creates for the tiny model's
    blocks (its names built from its rules above), each the PEFT LoRA's own factors and alpha: musubi-tuner reads
    every module with the trained delta (its W += alpha / rank * up @ down, exactly the same product)."""
    from tasks.training.export import to_kohya

    _, _, sd, blocks = _hv15_lora(adapter)
    file = to_kohya("hunyuan_video15", sd, 4, 8)
    musubi = {f"lora_unet.double_blocks.{i}.{m}".replace(".", "_"): f"transformer_blocks.{i}.{DIFFUSERS_OF[m]}"
              for i in range(blocks) for m in MUSUBI_LINEARS}
    assert {k.split(".")[0] for k in file} == set(musubi)
    for name, module in musubi.items():
        assert torch.equal(file[f"{name}.lora_down.weight"], sd[f"{module}.lora_A.weight"]), name
        assert torch.equal(file[f"{name}.lora_up.weight"], sd[f"{module}.lora_B.weight"]), name
        assert file[f"{name}.alpha"].item() == 8.0


def test_lora_memorises_its_clip(tmp_path):
    """bench/learns.py's check for `tiny_hunyuan_video15`: one 9-frame clip memorised, rendered by
    HunyuanVideo15Pipeline with the diffusers file (through the transformer's loader) and with the kohya file merged
    by ComfyUI's rule, each within the image families' bound (bench/learns.json); a halved scale is caught."""
    from bench import learns
    from learning import FILES, learns_within_bound

    base, files, r = learns_within_bound("tiny_hunyuan_video15", tmp_path)
    assert r["loaders"]["kohya"] == "merge"
    bad = tmp_path / "halved.safetensors"
    FILES["scale_halved"](files["diffusers"], bad)
    assert learns.evaluate("tiny_hunyuan_video15", base, {"diffusers": bad})["files"]["diffusers"] > learns.BOUND
