"""Kandinsky 5.0 image-to-video LoRAs (`model=tiny_kandinsky5_i2v`, tasks/models/kandinsky5_i2v.py): each clip
trains from its first frame as Kandinsky5I2VPipeline samples from an image (the clean first latent frame in the
noisy input, zero condition channels, mask 1 on that frame, the frames after it denoised).

- The tiny build is deterministic and is the text-to-video model's components in the I2V pipeline.
- The condition: the first frame encoded alone, cached per clip by cache_latents as a control entry.
- Training: the transformer gets what the pipeline's loop feeds it; the loss is on the frames after the first;
  one step gives non-zero LoRA gradients.
- `sample` from cached text and a --i image is the pipeline's own video from the prompt strings and that image.
- The nodes on two clips: an mp4 from the first frame; the kohya file in musubi-tuner's names for the I2V model.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks import cache_latents, publish, validate
from tasks.config import compose, resolve_paths
from tasks.config_schema import TrainConfig
from tasks.data.clips import inspect_clip, read_frames
from tasks.models.kandinsky5_i2v import Kandinsky5I2VAdapter
from tasks.models.tiny.tiny_kandinsky5_i2v import build_tiny_kandinsky5_i2v
from tasks.store import Store
from support import box_clip, run_nodes

L = 32
FPS = 8
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTION = "a red box moving right"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_kandinsky5_i2v(tmp_path_factory.mktemp("tiny_k5_i2v"))


@pytest.fixture(scope="module")
def adapter(model):
    return Kandinsky5I2VAdapter(model, "float32", L)


@pytest.fixture(scope="module")
def texts(adapter):
    return adapter.encode_text(adapter.load_text_encoders(), [CAPTION, ""])


def _pipe(model):
    from diffusers import Kandinsky5I2VPipeline

    pipe = Kandinsky5I2VPipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_build_is_deterministic_and_is_the_i2v_pipeline(model, tmp_path):
    again = build_tiny_kandinsky5_i2v(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)
    pipe = _pipe(model)
    assert type(pipe).__name__ == "Kandinsky5I2VPipeline" and pipe.transformer.config.visual_cond
    assert Kandinsky5I2VAdapter.controls.first_frame and Kandinsky5I2VAdapter.controls.required


def test_training_feeds_the_transformer_as_the_pipelines_loop_and_learns(adapter, texts):
    from peft import LoraConfig

    vae = adapter.load_vae()
    clip = torch.rand(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = adapter.encode_latents(vae, clip)  # [1, C, 3, 4, 4]
    (cond,) = adapter.encode_condition(vae, None, clip[:, :, 0], None, 9)
    assert cond["latents"].shape == (4, 1, 4, 4)
    torch.testing.assert_close(cond["latents"], adapter.encode_latents(vae, clip[:, :, :1])[0])
    text = {**{k: v[None] for k, v in texts[0].items()}, "control_latents": cond["latents"][None, None]}
    den = adapter.load_denoiser()
    x = adapter.visual_input(den, torch.randn(1, 3, 4, 4, 4), text)
    # prepare_latents: frame 0 is the image's latent, the condition channels zero, the mask 1 on frame 0 only
    assert torch.equal(x[:, :1, ..., :4], cond["latents"].permute(1, 2, 3, 0)[None])
    assert not x[..., 4:8].any() and x[:, 0, ..., 8].eq(1).all() and not x[:, 1:, ..., 8].any()
    den.requires_grad_(False)
    den.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets()))
    loss = adapter.training_loss(den, latents, text, TRAIN, adapter.load_train_scheduler(),
                                 [torch.Generator().manual_seed(1)])
    assert torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in den.parameters() if p.requires_grad)


def test_sample_from_cached_text_is_the_pipelines_video(adapter, texts, model):
    image = Image.fromarray((np.random.default_rng(0).random((32, 48, 3)) * 255).astype(np.uint8))
    pipe = adapter.load_sampler(None)
    video = adapter.sample(pipe, texts[0], None, texts[1], 48, 32, 2, 5.0, 1.0, seed=0, frames=17, fps=12.0,
                           controls=[image])
    assert len(video.frames) == 17 and {f.size for f in video.frames} == {(48, 32)}
    ref = _pipe(model)(image=image, prompt=CAPTION, negative_prompt="", width=48, height=32, num_frames=17,
                       num_inference_steps=2, guidance_scale=5.0, max_sequence_length=L,
                       generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    assert np.isfinite(ref).all()
    ref = (np.clip(ref, 0, 1) * 255).round().astype(np.int16)
    assert np.array_equal(np.stack([np.asarray(f) for f in video.frames]).astype(np.int16), ref)
    # 9 frames (3 latent frames): the pipeline's normalize_first_frame has no reference frames and gives NaN;
    # the adapter's pipelines skip it there (finite_first_frames), so the video is finite
    with np.errstate(invalid="ignore"):
        nan = _pipe(model)(image=image, prompt=CAPTION, negative_prompt="", width=48, height=32, num_frames=9,
                           num_inference_steps=2, guidance_scale=5.0, max_sequence_length=L,
                           generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    assert np.isnan(nan).any()
    short = adapter.sample(pipe, texts[0], None, texts[1], 48, 32, 2, 5.0, 1.0, seed=0, frames=9, fps=12.0,
                           controls=[image])
    assert len(short.frames) == 9 and np.isfinite(np.stack([np.asarray(f) for f in short.frames])).all()
    assert "normalize_first_frame" in vars(Kandinsky5I2VAdapter.reference_pipeline(model, L))  # the learning check's


def test_nodes_render_an_mp4_from_the_first_frame(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    box_clip(data / "red.mp4", 12, (255, 0, 0), FPS)
    box_clip(data / "green.mp4", 9, (0, 255, 0), FPS)
    for stem, caption in (("red", CAPTION), ("green", "a green box moving right")):
        (data / f"{stem}.txt").write_text(caption + "\n")
    Image.fromarray(read_frames(data / "red.mp4", 1)[0]).save(tmp_path / "first.png")
    (tmp_path / "prompts.txt").write_text(f"{CAPTION} --i first.png\n")
    cfg = resolve_paths(compose("train", [
        "model=tiny_kandinsky5_i2v", f"data.dir={data}", f"store.root={tmp_path / 'store'}", "data.resolution=32",
        "data.frames=9", f"sample.prompts_file={tmp_path / 'prompts.txt'}", "train.max_steps=2",
        "train.batch_size=1", "train.log_with=none", "sample.steps=2", "export.format=both"])[0])
    store = Store(tmp_path / "store")
    plan, lat, txt, lora, smp = run_nodes(cfg, store)
    assert set(lat["items"]) == {"red.mp4", "green.mp4", "control:red.mp4:0", "control:green.mp4:0"}
    assert tuple(store.tensor_shapes(cache_latents.KIND, lat["items"]["control:green.mp4:0"])["latents"]) == (4, 1, 4, 4)
    (file,) = [Path(p) for p in smp["samples"]]
    info = inspect_clip(file)[1]
    assert file.suffix == ".mp4" and (info.frames, info.width, info.height) == (9, 32, 32)
    from safetensors import safe_open

    with safe_open(str(publish.kohya_file(cfg, plan, store, lora)), "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["ss_base_model_version"] == "kandinsky5_i2v" and meta["ss_network_module"] == "networks.lora_kandinsky"
    assert "lora_unet_visual_transformer_blocks_0_cross_attention_to_query.alpha" in keys
    pipe = _pipe(plan.model_dir)
    pipe.load_lora_weights(str(publish.diffusers_file(store, lora)))
    assert any("lora_A" in n for n, _ in pipe.transformer.named_parameters())


def test_lora_memorises_its_clip_from_its_first_frame(tmp_path):
    """bench/learns.py's check for `tiny_kandinsky5_i2v`: one 9-frame clip memorised from its first frame, rendered
    by Kandinsky5I2VPipeline from that frame with the diffusers file (load_lora_weights) and with the kohya file
    merged by ComfyUI's rule, each within the bound."""
    from learning import learns_within_bound

    _, _, r = learns_within_bound("tiny_kandinsky5_i2v", tmp_path)
    assert r["loaders"]["kohya"] == "merge"
