"""Issue 33: LTX-2 video LoRAs (`model=tiny_ltx2`, tasks/models/ltx2.py and tiny_ltx2.py), at the adapter (no nodes):
the tiny LTX2Pipeline is built offline, deterministically, with LTX-2's VAE geometry (1 + 8k frames, /32 in space).

- Latents: a 9-frame clip -> 2 latent frames, an image -> 1, normalised as LTX2Pipeline un-normalises them.
- Text: every caption stored at max_sequence_length (the connectors' outputs and mask), for sampling without Gemma.
- One training step with a peft LoRA on the video stream's default targets: a finite loss, non-zero LoRA gradients,
  no LoRA on the audio stream, and a video prediction that does not read the audio (video-only training).
- `sample` renders a Video of the requested frames, size and rate, the pipeline's own from the prompt string.
- The saved LoRA loads with LTX2Pipeline.load_lora_weights and changes the transformer's output.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.config_schema import TrainConfig
from tasks.config import ConfigError
from tasks.data.clips import Video
from tasks.models.ltx2 import LTX2Adapter
from tasks.models.tiny.tiny_ltx2 import build_tiny_ltx2

REPO = Path(__file__).resolve().parents[1]
L = 32  # Gemma tokens (tiny_ltx2.yaml's max_sequence_length)
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_ltx2(tmp_path_factory.mktemp("tiny_ltx2"))


@pytest.fixture(scope="module")
def adapter(model):
    return LTX2Adapter(model, "float32", L)


@pytest.fixture(scope="module")
def texts(adapter):
    return adapter.encode_text(adapter.load_text_encoders(), ["a red box moving right", "a blue circle", ""])


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_build_is_deterministic_and_has_ltx2_geometry(model, tmp_path):
    from diffusers import LTX2Pipeline

    again = build_tiny_ltx2(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = LTX2Pipeline.from_pretrained(model, use_safetensors=True)
    assert (pipe.vae_temporal_compression_ratio, pipe.vae_spatial_compression_ratio) == (8, 32)
    assert (LTX2Adapter.clips.frame_step, LTX2Adapter.size_multiple) == (8, 32)
    assert type(pipe.text_encoder).__name__ == "Gemma3ForConditionalGeneration"
    assert type(pipe.tokenizer).__name__ == "GemmaTokenizer" and pipe.tokenizer("a red").input_ids[0] == 2  # <bos>


def test_clip_and_image_latents(adapter):
    from diffusers import LTX2Pipeline

    vae = adapter.load_vae()
    clip = torch.rand(1, 3, 9, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = adapter.encode_latents(vae, clip)
    assert z.shape == (1, 8, 2, 2, 3)  # 1 + (9 - 1) / 8 latent frames, /32 in space
    image = adapter.encode_latents(vae, clip[:, :, 0])  # an image: a one-frame video
    assert image.shape == (1, 8, 1, 2, 3)
    # the causal VAE encodes the first frame alone: the same sums, in an order that may differ with the clip's length
    # (conv3d picks its kernel by shape), so float32's default closeness (rtol 1.3e-6 ~ 11 eps, atol 1e-5 on
    # latents of magnitude ~1), not bytes
    torch.testing.assert_close(image[:, :, 0], z[:, :, 0])
    # stored normalised: the pipeline's un-normalising before vae.decode gives back the VAE's own latents
    raw = vae.encode(clip).latent_dist.mode()
    back = LTX2Pipeline._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    torch.testing.assert_close(back, raw)  # (z - m) * s / d, then * d / s + m: a few float32 roundings
    assert not torch.allclose(z, raw)  # the tiny VAE's statistics are not 0 / 1


def test_text_is_stored_per_caption_at_fixed_length(texts):
    for d in texts:  # captions of any length (the empty one too) stack into one batch
        assert set(d) == {"prompt_embeds", "audio_prompt_embeds", "attention_mask"}
        assert d["prompt_embeds"].shape == d["audio_prompt_embeds"].shape == (L, 32)
        assert d["attention_mask"].shape == (L,) and d["attention_mask"].dtype == torch.int64
    assert not torch.equal(texts[0]["prompt_embeds"], texts[1]["prompt_embeds"])


def test_one_training_step_trains_the_video_stream_only(adapter, texts):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets()))
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    assert len(modules) == 2 * 10  # per block: attn1 and attn2 q/k/v/out, ff in and out
    assert not any("audio" in n for n in modules)
    latents = torch.randn(2, 8, 2, 2, 2, generator=torch.Generator().manual_seed(1))
    text = {k: torch.stack([texts[0][k], texts[1][k]]) for k in texts[0]}
    scheduler = adapter.load_train_scheduler()
    loss = adapter.training_loss(denoiser, latents, text, TRAIN, scheduler, _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in lora.values() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():
        # video only: the audio stream's text does not reach the video prediction (no cross-modal attention)
        silent = {**text, "audio_prompt_embeds": torch.zeros_like(text["audio_prompt_embeds"])}
        assert adapter.training_loss(denoiser, latents, silent, TRAIN, scheduler, _gens(2)) == loss
        # the frame rate is the RoPE's time axis: per item when the batch carries it, LTX-2's 24 fps otherwise
        at24 = adapter.training_loss(denoiser, latents, {**text, "fps": torch.tensor([24.0, 24.0])}, TRAIN,
                                     scheduler, _gens(2))
        at8 = adapter.training_loss(denoiser, latents, {**text, "fps": torch.tensor([8.0, 8.0])}, TRAIN,
                                    scheduler, _gens(2))
        assert at24 == loss and at8 != loss


def test_sample_is_the_pipelines_video(adapter, texts, model):
    from diffusers import LTX2Pipeline

    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    video = adapter.sample(pipe, texts[0], None, texts[2], 96, 64, 2, 3.0, 1.0, seed=0, frames=9, fps=12.0)
    assert isinstance(video, Video) and len(video.frames) == 9 and video.fps == 12.0
    assert {f.size for f in video.frames} == {(96, 64)}
    with pytest.raises(ConfigError, match="64 px or more"):  # one latent cell: LTX-2's decoder cannot pad it
        adapter.sample(pipe, texts[0], None, texts[2], 32, 64, 2, 3.0, 1.0, seed=0, frames=9, fps=12.0)
    # the same video as LTX2Pipeline from the prompt strings (its Gemma and connectors), at this family's settings
    full = LTX2Pipeline.from_pretrained(model, use_safetensors=True)
    full.set_progress_bar_config(disable=True)
    ref = full(prompt="a red box moving right", negative_prompt="", width=96, height=64, num_frames=9, frame_rate=12.0,
               num_inference_steps=2, guidance_scale=3.0, stg_scale=0.0, audio_stg_scale=0.0,
               spatio_temporal_guidance_blocks=None, use_cross_timestep=False, max_sequence_length=L,
               generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    ref = (np.clip(ref, 0, 1) * 255).round().astype(np.int16)
    mine = np.stack([np.asarray(f) for f in video.frames]).astype(np.int16)
    assert np.abs(mine - ref).max() <= 1  # its text batched otherwise: at most a rounding step apart


def test_saved_lora_loads_into_the_pipeline_and_changes_the_transformer(adapter, texts, model, tmp_path):
    from diffusers import LTX2Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                    target_modules=adapter.default_lora_targets()))
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    text = {k: v[None] for k, v in texts[0].items()}
    latents = torch.randn(1, 8, 2, 2, 2, generator=torch.Generator().manual_seed(2))
    adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))
    assert file.is_file()

    pipe = LTX2Pipeline.from_pretrained(model, use_safetensors=True)
    t = pipe.transformer
    inputs = dict(hidden_states=torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(3)),
                  audio_hidden_states=torch.zeros(1, 1, t.config.audio_in_channels),
                  encoder_hidden_states=text["prompt_embeds"], audio_encoder_hidden_states=text["audio_prompt_embeds"],
                  timestep=torch.tensor([500.0]), encoder_attention_mask=text["attention_mask"],
                  audio_encoder_attention_mask=text["attention_mask"], num_frames=2, height=2, width=2,
                  audio_num_frames=1, return_dict=False)
    with torch.no_grad():
        before = t(**inputs)[0]
        pipe.load_lora_weights(str(file))
        assert sum("lora_A" in n for n in t.state_dict()) == 20
        after = t(**inputs)[0]
    assert (after - before).abs().max() > 1e-4


def test_whole_dag_on_the_demo_clips(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> publish through `model=tiny_ltx2` on the demo
    clips (4 clips of 17 frames at 16 fps, one still image), 9 frames at 64 px; each latent stored with the frame
    rate it was taken at, which training feeds to the RoPE."""
    from tasks import cache_latents, cache_text, publish, sample, train, validate
    from tasks.config import compose, resolve_paths
    from tasks.data.clips import inspect_clip
    from tasks.store import Store

    def cfg(*extra):
        return resolve_paths(compose("train", [
            "model=tiny_ltx2", "data=demo_clips", "data.frames=9", f"store.root={tmp_path / 'store'}",
            f"sample.prompts_file={REPO / 'data' / 'demo_clips_prompts.txt'}", "train.max_steps=2",
            "train.batch_size=2", "train.log_with=none", "sample.steps=2", *extra])[0])

    store = Store(tmp_path / "store")
    c = cfg()
    plan = validate.run(c, store)
    lat, txt = cache_latents.run(c, plan, store), cache_text.run(c, plan, store)
    stored = store.get_tensors(cache_latents.KIND, lat["items"]["red_circle_right.mp4"])
    assert stored["latents"].shape[1] == 2 and float(stored["fps"]) == 16.0  # 1 + (9 - 1) / 8 latent frames
    assert float(store.get_tensors(cache_latents.KIND, lat["items"]["still.png"])["fps"]) == LTX2Adapter.clips.default_fps
    lora = train.run(c, plan, store, lat["items"], txt["items"])
    smp = sample.run(c, plan, store, lora["key"], lora["lora"], txt["items"])
    art = publish.publish(c, plan, store, tmp_path / "run", lora, smp["samples"])
    assert [inspect_clip(p)[1].frames for p in art["samples"]] == [9, 9]  # data.frames; --f 9 on the second line
    with pytest.raises(ConfigError, match="renders sides of 64 px or more"):
        validate.run(cfg("data.resolution=32"), store)


# ComfyUI's LTX-2 model (comfy/ldm/lightricks/av_model.py at ComfyUI commit b321b7a28d7c62626f728db1c67555637d080a76:
# LTXAVModel's `transformer_blocks.N` are BasicAVTransformerBlock, whose video stream is attn1 / attn2 (model.py's
# CrossAttention: to_q, to_k, to_v, to_out.0) and ff (FeedForward: net.0 = GELU_approx's proj, net.2), the audio
# stream audio_attn1 / audio_attn2 / audio_ff, and audio_to_video_attn / video_to_audio_attn between them).
COMFY_BLOCK = {f"{a}.{p}" for a in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn",
                                    "video_to_audio_attn") for p in ("to_q", "to_k", "to_v", "to_out.0")} | {
    f"{f}.{p}" for f in ("ff", "audio_ff") for p in ("net.0.proj", "net.2")}


def test_kohya_file_is_mapped_completely_by_comfyui(adapter):
    """Every key of the LTX-2 kohya file (= its ComfyUI file) is read by ComfyUI's generic `lora_unet_<model key>`
    rule (tests/test_comfyui_keys.py restates it) against ComfyUI's own block names, and merges to the PEFT LoRA's
    delta: no 'lora key not loaded'."""
    import re

    from lora_fixtures import random_lora
    from support import REL
    from support import comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya

    den = adapter.load_denoiser()
    linears = {n: m for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}
    in_blocks = {n: m for n, m in linears.items() if re.match(r"transformer_blocks\.\d+\.", n)}
    # ComfyUI's keys for the block Linears, by its names (the diffusers names of these modules are the same)
    comfy_keys = {n: (m.out_features, m.in_features) for n, m in in_blocks.items()
                  if n.split(".", 2)[2] in COMFY_BLOCK}
    sd, _ = random_lora(den, adapter.default_lora_targets(), 4, 8)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert modules and modules <= set(comfy_keys)  # every trained module is one of ComfyUI's
    merged = comfyui_merge("ltx2", to_kohya("ltx2", sd, 4, 8), comfy_keys)  # fails on a key left unread
    assert set(merged) == modules
    for m in modules:
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[m] - want).abs().max() <= REL * want.abs().max(), m
    assert comfyui_loads_kohya("ltx2")


def test_the_chain_probes_as_trained_render_reads_no_audio(model):
    """bench.learns_chain (issue 48 item 2): LTX-2's "as_trained" render has no audio-to-video attention, as its video
    LoRA trains: its video is the same whatever audio the pipeline generates beside it (exact: the video tokens' own
    arithmetic is unchanged); the pipeline as it is reads that audio in every block."""
    from diffusers import LTX2Pipeline

    from bench.learns_chain import VARIANTS

    def video(pipe, audio_guidance):  # the audio trajectory differs by its CFG scale; the video's settings do not
        return pipe(prompt="a red box moving right", negative_prompt="", width=64, height=64, num_frames=9,
                    frame_rate=12.0, num_inference_steps=2, guidance_scale=1.0, modality_scale=1.0,
                    audio_guidance_scale=audio_guidance, stg_scale=0.0, audio_stg_scale=0.0,
                    spatio_temporal_guidance_blocks=None, use_cross_timestep=False, max_sequence_length=L,
                    generator=torch.Generator().manual_seed(0), output_type="latent").frames

    pipe = LTX2Pipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    assert not torch.equal(video(pipe, 4.0), video(pipe, 7.0))  # joint: the audio reaches the video
    isolated = VARIANTS["tiny_ltx2"]["as_trained"](pipe)
    assert torch.equal(video(isolated, 4.0), video(isolated, 7.0))
