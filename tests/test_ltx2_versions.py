"""Issue 64 item 3: LTX-2.3 and LTX-2.5 through the `ltx2` family (tasks/models/ltx2.py), with tiny pipelines of each
version's layout (tasks/models/tiny/tiny_ltx2_versions.py; `model=tiny_ltx23` / `model=tiny_ltx25`: arch.version).

For each version:
- The tiny model builds deterministically (same bytes from build_tiny_ltx2 with arch.version and from its own
  builder) with the version's switches: per-modality connectors, cross-attention modulation, gated and perturbed
  attention, no caption projection; Gemma 3 (2.3) or Gemma 4 (2.5, with a duration head) as the text encoder.
- encode_text stores exactly what LTX2Pipeline's encode_prompt and connectors make of the captions (the video and
  audio connectors' outputs at their own widths), without loading the duration head.
- One training step with a peft LoRA on the video stream: a finite loss, non-zero LoRA gradients, no audio module,
  and a video prediction that does not read the audio text.
- `sample` from the cached text renders the pipeline's own video from the prompt strings at this family's settings.
- The saved LoRA loads with LTX2Pipeline.load_lora_weights and changes the transformer's output.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.config_schema import TrainConfig
from tasks.data.clips import Video
from tasks.models.ltx2 import LTX2Adapter
from tasks.models.tiny.tiny_ltx2_versions import build_tiny_ltx2
from tasks.models.tiny.tiny_ltx2_versions import build_tiny_ltx23, build_tiny_ltx25

L = 32  # Gemma tokens (tiny_ltx23.yaml / tiny_ltx25.yaml's max_sequence_length)
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
BUILDERS = {"2.3": build_tiny_ltx23, "2.5": build_tiny_ltx25}
TEXT_ENCODERS = {"2.3": "Gemma3ForConditionalGeneration", "2.5": "Gemma4UnifiedForConditionalGeneration"}
CAPTIONS = ["a red box moving right", "a blue circle", ""]


@pytest.fixture(scope="module", params=["2.3", "2.5"])
def version(request):
    return request.param


@pytest.fixture(scope="module")
def model(version, tmp_path_factory):
    return BUILDERS[version](tmp_path_factory.mktemp(f"tiny_ltx{version.replace('.', '')}"))


@pytest.fixture(scope="module")
def adapter(model):
    return LTX2Adapter(model, "float32", L)


@pytest.fixture(scope="module")
def texts(adapter):
    return adapter.encode_text(adapter.load_text_encoders(), CAPTIONS)


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _pipe(model):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_build_is_deterministic_and_has_the_versions_layout(version, model, tmp_path):
    again = build_tiny_ltx2(tmp_path / "again", arch={"version": float(version)})  # YAML's unquoted number too
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = _pipe(model)
    assert type(pipe.text_encoder).__name__ == TEXT_ENCODERS[version]
    assert (pipe.vae_temporal_compression_ratio, pipe.vae_spatial_compression_ratio) == (8, 32)
    t, c = pipe.transformer.config, pipe.connectors.config
    assert t.cross_attn_mod and t.audio_cross_attn_mod and t.gated_attn and t.perturbed_attn
    assert not t.use_prompt_embeddings and c.per_modality_projections
    assert (c.video_hidden_dim, c.audio_hidden_dim) == (t.cross_attention_dim, t.audio_cross_attention_dim) == (16, 8)
    assert type(pipe.vocoder).__name__ == "LTX2VocoderWithBWE"
    assert (t.ff_bias, t.use_keyframes_abs_pos_embedding) == ((False, True) if version == "2.5" else (True, False))
    assert (pipe.duration_head is not None) == (version == "2.5")
    with pytest.raises(ValueError, match="unknown arch keys"):  # 2.0's connector sizes are derived here
        build_tiny_ltx2(tmp_path / "bad", arch={"version": version, "connector_heads": 2})


def test_encode_text_is_the_pipelines_encode_prompt_and_connectors(version, adapter, texts, model):
    encoders = adapter.load_text_encoders()
    assert encoders.duration_head is None and encoders.transformer is None
    assert type(encoders.text_encoder).__name__ == TEXT_ENCODERS[version]
    for d in texts:  # the video and audio connectors' outputs at their own widths, every caption at L tokens
        assert d["prompt_embeds"].shape == (L, 16) and d["audio_prompt_embeds"].shape == (L, 8)
        assert d["attention_mask"].shape == (L,) and d["attention_mask"].dtype == torch.int64
    assert not torch.equal(texts[0]["prompt_embeds"], texts[1]["prompt_embeds"])
    pipe = _pipe(model)
    with torch.no_grad():  # as LTX2Pipeline.__call__ runs them
        embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, max_sequence_length=L)
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
    for i, d in enumerate(texts):
        assert torch.equal(d["prompt_embeds"], video[i]) and torch.equal(d["audio_prompt_embeds"], audio[i])
        assert torch.equal(d["attention_mask"], mask[i].to(torch.int64))


def test_one_training_step_trains_the_video_stream_only(adapter, texts):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets()))
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    assert len(modules) == 2 * 10 and not any("audio" in n for n in modules)  # ltx-trainer's video-only targets
    latents = torch.randn(2, 8, 2, 2, 2, generator=torch.Generator().manual_seed(1))
    text = {k: torch.stack([texts[0][k], texts[1][k]]) for k in texts[0]}
    scheduler = adapter.load_train_scheduler()
    loss = adapter.training_loss(denoiser, latents, text, TRAIN, scheduler, _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in lora.values() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():  # video only: the audio stream's text does not reach the video prediction
        silent = {**text, "audio_prompt_embeds": torch.zeros_like(text["audio_prompt_embeds"])}
        assert adapter.training_loss(denoiser, latents, silent, TRAIN, scheduler, _gens(2)) == loss


def test_sample_from_cached_text_is_the_pipelines_video_from_strings(adapter, texts, model):
    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None and pipe.tokenizer is None and pipe.duration_head is None
    video = adapter.sample(pipe, texts[0], None, texts[2], 96, 64, 2, 3.0, 1.0, seed=0, frames=9, fps=12.0)
    assert isinstance(video, Video) and len(video.frames) == 9 and video.fps == 12.0
    assert {f.size for f in video.frames} == {(96, 64)}
    # LTX2Pipeline from the prompt strings (its Gemma and connectors) as it is for LTX-2.3/2.5: its STG defaults
    # (perturbed attention), the cross-modality timestep
    ref = _pipe(model)(prompt=CAPTIONS[0], negative_prompt="", width=96, height=64, num_frames=9, frame_rate=12.0,
                       num_inference_steps=2, guidance_scale=3.0, use_cross_timestep=True, max_sequence_length=L,
                       generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    ref = (np.clip(ref, 0, 1) * 255).round().astype(np.int16)
    mine = np.stack([np.asarray(f) for f in video.frames]).astype(np.int16)
    assert np.abs(mine - ref).max() <= 1  # its text batched otherwise: at most a rounding step apart


def test_saved_lora_loads_into_the_pipeline_and_changes_the_transformer(adapter, texts, model, tmp_path):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                    target_modules=adapter.default_lora_targets()))
    optimizer = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)
    text = {k: v[None] for k, v in texts[0].items()}
    latents = torch.randn(1, 8, 2, 2, 2, generator=torch.Generator().manual_seed(2))
    adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))
    assert file.is_file()

    pipe = _pipe(model)
    t = pipe.transformer
    inputs = dict(hidden_states=torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(3)),
                  audio_hidden_states=torch.zeros(1, 1, t.config.audio_in_channels),
                  encoder_hidden_states=text["prompt_embeds"], audio_encoder_hidden_states=text["audio_prompt_embeds"],
                  timestep=torch.tensor([500.0]), sigma=torch.tensor([500.0]),
                  encoder_attention_mask=text["attention_mask"], audio_encoder_attention_mask=text["attention_mask"],
                  num_frames=2, height=2, width=2, audio_num_frames=1, return_dict=False)
    with torch.no_grad():
        before = t(**inputs)[0]
        pipe.load_lora_weights(str(file))
        assert sum("lora_A" in n for n in t.state_dict()) == 20
        after = t(**inputs)[0]
    assert (after - before).abs().max() > 1e-4


def test_ltx25_without_the_prompt_adaln_trains(tmp_path):
    """diffusers' transformer docs call LTX-2.5's text cross-attention modulation timestep-independent
    (use_prompt_adaln_single=False) where its 2.5 preset keeps the default: the adapter trains either."""
    from peft import LoraConfig

    model = build_tiny_ltx25(tmp_path / "m", arch={"prompt_adaln_single": False})
    adapter = LTX2Adapter(model, "float32", L)
    texts = adapter.encode_text(adapter.load_text_encoders(), CAPTIONS[:1])
    denoiser = adapter.load_denoiser()
    assert not denoiser.config.use_prompt_adaln_single and not hasattr(denoiser, "prompt_adaln")
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, init_lora_weights="gaussian", target_modules=adapter.default_lora_targets()))
    text = {k: v[None] for k, v in texts[0].items()}
    latents = torch.randn(1, 8, 2, 2, 2, generator=torch.Generator().manual_seed(4))
    loss = adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1))
    assert torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in denoiser.parameters() if p.requires_grad)


@pytest.mark.parametrize("name, version", [("tiny_ltx23", "2.3"), ("tiny_ltx25", "2.5"), ("ltx23", None),
                                           ("ltx25", None)])
def test_presets_are_the_ltx2_family(name, version):
    from tasks.config import compose

    cfg = compose("train", [f"model={name}"])[0]
    assert cfg.model.family == "ltx2" and cfg.model.max_sequence_length % (8 if version else 128) == 0
    if version:
        assert str(cfg.model.arch["version"]) == version and cfg.model.path is None


@pytest.mark.parametrize("name", ["tiny_ltx23", "tiny_ltx25"])
def test_whole_dag_on_the_demo_clips(name, tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> publish through `model=tiny_ltx23` /
    `model=tiny_ltx25` (the tiny model built from the preset's arch.version), 9 frames at 64 px."""
    from pathlib import Path

    from tasks import cache_latents, cache_text, publish, sample, train, validate
    from tasks.config import compose, resolve_paths
    from tasks.data.clips import inspect_clip
    from tasks.store import Store

    repo = Path(__file__).resolve().parents[1]
    c = resolve_paths(compose("train", [
        f"model={name}", "data=demo_clips", "data.frames=9", f"store.root={tmp_path / 'store'}",
        f"sample.prompts_file={repo / 'data' / 'demo_clips_prompts.txt'}", "train.max_steps=2",
        "train.batch_size=2", "train.log_with=none", "sample.steps=2"])[0])
    store = Store(tmp_path / "store")
    plan = validate.run(c, store)
    lat, txt = cache_latents.run(c, plan, store), cache_text.run(c, plan, store)
    lora = train.run(c, plan, store, lat["items"], txt["items"])
    smp = sample.run(c, plan, store, lora["key"], lora["lora"], txt["items"])
    art = publish.publish(c, plan, store, tmp_path / "run", lora, smp["samples"])
    assert [inspect_clip(p)[1].frames for p in art["samples"]] == [9, 9]
