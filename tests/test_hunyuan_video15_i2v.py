"""Issue 47: HunyuanVideo 1.5 image-to-video LoRAs (`model=tiny_hunyuan_video15_i2v`,
tasks/models/hunyuan_video15_i2v.py), at the node functions and against diffusers' own
HunyuanVideo15ImageToVideoPipeline (real mp4 clips, real pipeline parts):

- the condition loraflow caches is what the pipeline builds from the same first frame: prepare_cond_latents_and_mask
  (the first frame's latent, zero after it, and the mask channel) and encode_image (SigLIP's last_hidden_state);
- the training call feeds the transformer what the pipeline's denoising loop feeds it (the same kwargs, shapes and
  conditioning parts), and the sampler's call is the pipeline's own at its own size rule;
- the nodes run on two clips and render an mp4 sample from `--i`; the files carry the I2V model's names.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks import cache_latents, cache_text, publish, validate
from tasks.config import compose, resolve_paths
from tasks.data.clips import inspect_clip, read_frames
from tasks.models import make_adapter
from tasks.store import Store
from support import box_clip, run_nodes

FPS = 8
MODEL = "tiny_hunyuan_video15_i2v"
CAPTION = "a red box moving right"


def _clip(path: Path, n: int, color, fps: float = FPS) -> Path:
    return box_clip(path, n, color, fps)


@pytest.fixture
def clips(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _clip(data / "red.mp4", 12, (255, 0, 0))
    _clip(data / "green.mp4", 9, (0, 255, 0))
    for stem, caption in (("red", CAPTION), ("green", "a green box moving right")):
        (data / f"{stem}.txt").write_text(caption + "\n")
    Image.fromarray(read_frames(data / "red.mp4", 1)[0]).save(tmp_path / "first.png")
    (tmp_path / "prompts.txt").write_text(f"{CAPTION} --i first.png\n")
    return tmp_path


def _cfg(root, *extra):
    return resolve_paths(compose("train", [
        f"model={MODEL}", f"data.dir={root / 'data'}", f"store.root={root / 'store'}", "data.resolution=32",
        "data.frames=9", f"sample.prompts_file={root / 'prompts.txt'}", "train.max_steps=2", "train.batch_size=1",
        "train.log_with=none", "sample.steps=2", *extra])[0])


def _spy(model) -> list[dict]:
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls


def _pipe(model_dir):
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(model_dir, use_safetensors=True, text_encoder=None,
                                                              tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _first_frame(clips) -> Image.Image:
    """The red clip's first frame as loraflow fits it to 32x32 (a square: resized, bicubic, nothing cropped)."""
    first = read_frames(clips / "data" / "red.mp4", 1, FPS)[0]
    return Image.fromarray(first).resize((32, 32), Image.Resampling.BICUBIC)


def _cached(clips):
    cfg, store = _cfg(clips), Store(clips / "store")
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return cfg, store, plan, lat, txt


def test_the_condition_is_the_pipelines(clips):
    """What cache_latents stores for a clip's first frame is what the pipeline's __call__ builds from that image:
    prepare_cond_latents_and_mask ([C latent channels, zero after the first latent frame | the mask, 1 on it]) and
    encode_image (the SigLIP feature extractor and last_hidden_state). Tolerance: the same ops run on the same
    input here (loraflow's pixels x / 127.5 - 1 and the pipeline's 2 (x / 255) - 1 are the same float32 values for
    every uint8 x, asserted; the VAE and SigLIP in the same dtype and batch size 1), so the results are exact; the
    bound allows 4 float32 ulps of the largest value (4 * eps * max |z|) should a kernel reorder a sum."""
    cfg, store, plan, lat, _ = _cached(clips)
    stored = store.get_tensors(cache_latents.KIND, lat["items"]["control:red.mp4:0"])
    pipe = _pipe(plan.model_dir)
    first = _first_frame(clips)
    x = np.arange(256, dtype=np.uint8)
    assert np.array_equal(x.astype(np.float32) / 127.5 - 1.0, 2.0 * (x.astype(np.float32) / 255.0) - 1.0)
    # as __call__: the image resized to its size (here the training size), the latents of 9 frames, the condition
    image = pipe.video_processor.resize(first, height=32, width=32, resize_mode="crop")
    latents = pipe.prepare_latents(1, pipe.num_channels_latents, 32, 32, 9, torch.float32, "cpu",
                                   torch.Generator().manual_seed(0))
    with torch.no_grad():
        cond, mask = pipe.prepare_cond_latents_and_mask(latents, image, 1, 32, 32, torch.float32, "cpu")
        embeds = pipe.encode_image(image, 1, "cpu", torch.float32)
    want = torch.cat([cond, mask], dim=1)[0]  # [C + 1, F', h, w]
    c = pipe.num_channels_latents
    assert stored["latents"].shape == want.shape == (c + 1, 3, 2, 2)
    assert (want[:c, 1:] == 0).all() and (want[c, 0] == 1).all() and (want[c, 1:] == 0).all()
    tol = 4 * torch.finfo(torch.float32).eps
    assert (stored["latents"] - want).abs().max() <= tol * want.abs().max()
    assert stored["image_embeds"].shape == embeds[0].shape == (16, 16)  # 4 x 4 SigLIP patches of 16 wide
    assert (stored["image_embeds"] - embeds[0]).abs().max() <= tol * embeds.abs().max()
    assert set(stored) == {"latents", "image_embeds"}


def test_training_feeds_the_transformer_as_the_pipelines_loop(clips):
    """One training step and one denoising step of the pipeline (from the same first frame and cached text), each
    spied at the transformer's forward: the same kwargs (the pipeline's extra timestep_r / attention_kwargs are
    None), the same shapes and dtypes, the same conditioning (channels after the noisy latents, image_embeds,
    text). The whole clip is noised, the first frame included (the pipeline starts every frame from noise), and
    the timestep is [B] in the latents' dtype, t = sigma x 1000. The sampler's call (the size the prompt asks)
    feeds the same as the pipeline sized by its own rule (target_size 32: the 32x32 bucket for a square image)."""
    cfg, store, plan, lat, txt = _cached(clips)
    adapter = make_adapter(cfg.model, Path(plan.model_dir))
    latents = store.get_tensors(cache_latents.KIND, lat["items"]["red.mp4"])["latents"][None]
    control = store.get_tensors(cache_latents.KIND, lat["items"]["control:red.mp4:0"])
    text = store.get_tensors(cache_text.KIND, cache_text.text_key(cfg, plan, CAPTION))
    empty = store.get_tensors(cache_text.KIND, cache_text.text_key(cfg, plan, ""))
    denoiser = adapter.load_denoiser()
    train_calls = _spy(denoiser)
    batch = {**{k: v[None] for k, v in text.items()}, "control_latents": control["latents"][None, None],
             "control_image_embeds": control["image_embeds"][None, None]}
    loss = adapter.training_loss(denoiser, latents, batch, cfg.train, adapter.load_train_scheduler(),
                                 [torch.Generator().manual_seed(1)])
    assert torch.isfinite(loss)
    (train,) = train_calls

    pipe = _pipe(plan.model_dir)
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 32, 32  # as the adapter caches text
    pipe.guider = pipe.guider.new(guidance_scale=1.0)  # one conditional call a step
    pipe.target_size = 32
    pipe_calls = _spy(pipe.transformer)
    pipe(image=_first_frame(clips), num_frames=9, num_inference_steps=1, output_type="latent",
         generator=torch.Generator().manual_seed(0), **{k: v[None] for k, v in text.items()})
    (ref,) = pipe_calls
    assert set(train) <= set(ref) and all(ref[k] is None for k in set(ref) - set(train))
    for k in train:
        if isinstance(train[k], torch.Tensor):
            assert train[k].shape == ref[k].shape and train[k].dtype == ref[k].dtype, k
    c = latents.shape[1]
    assert train["hidden_states"].shape == (1, 2 * c + 1, *latents.shape[2:])
    assert torch.equal(train["hidden_states"][:, c:], ref["hidden_states"][:, c:])  # condition + mask, clean
    assert not torch.equal(train["hidden_states"][:, :c, :1], latents[:, :, :1])  # the first frame noised too
    assert torch.equal(train["image_embeds"], ref["image_embeds"]) and train["image_embeds"].abs().sum() > 0
    for k in ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2"):
        assert torch.equal(train[k], ref[k]), k
    assert train["timestep"].shape == (1,) and 0 < float(train["timestep"][0]) <= 1000

    # the sampler: the pipeline called at the prompt's size, from the --i image fitted to it
    sampler = adapter.load_sampler(None)
    sample_calls = _spy(sampler.transformer)
    video = adapter.sample(sampler, text, None, empty, 32, 32, 1, 1.0, 1.0, 0, frames=9, fps=8.0,
                           controls=[_first_frame(clips)])
    assert len(video.frames) == 9 and video.frames[0].size == (32, 32)
    assert "calculate_default_height_width" not in vars(sampler.video_processor)  # the pipeline's own rule again
    got = sample_calls[0]
    assert torch.equal(got["hidden_states"], ref["hidden_states"]) and torch.equal(got["image_embeds"], ref["image_embeds"])


def test_nodes_render_an_mp4_from_the_first_frame(clips):
    """validate, cache_latents, cache_text, train and sample on two clips: each clip's condition is a control
    entry (latent + mask channels, SigLIP states), the sample an mp4 of the clip's frames from `--i`."""
    Image.new("RGB", (40, 40), (0, 0, 255)).save(clips / "data" / "still.png")  # an image: no I2V item
    (clips / "data" / "still.txt").write_text("a blue square\n")
    cfg, store = _cfg(clips, "export.format=both"), Store(clips / "store")
    plan, lat, txt, lora, smp = run_nodes(cfg, store)
    assert {it["name"] for it in plan.items} == {"red.mp4", "green.mp4"}
    assert {f["file"]: f["policy"] for f in plan.dataset} == {"still.png": "ignored"}
    assert set(lat["items"]) == {"red.mp4", "green.mp4", "control:red.mp4:0", "control:green.mp4:0"}
    shapes = store.tensor_shapes(cache_latents.KIND, lat["items"]["control:green.mp4:0"])
    assert tuple(shapes["latents"]) == (9, 3, 2, 2) and tuple(shapes["image_embeds"]) == (16, 16)
    (file,) = [Path(p) for p in smp["samples"]]
    info = inspect_clip(file)[1]
    assert file.suffix == ".mp4" and (info.frames, info.width, info.height) == (9, 32, 32)
    # the files: musubi-tuner's names for the I2V model, and the diffusers file loads into the I2V pipeline
    from safetensors import safe_open

    kohya = publish.kohya_file(cfg, plan, store, lora)
    with safe_open(str(kohya), "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["ss_base_model_version"] == "hunyuan_video_1_5_i2v" and meta["ss_network_module"] == "networks.lora_hv_1_5"
    assert {"lora_unet_double_blocks_0_img_attn_q.alpha", "lora_unet_double_blocks_1_txt_mlp_fc2.alpha"} <= keys
    pipe = _pipe(plan.model_dir)
    pipe.transformer.load_lora_adapter(str(publish.diffusers_file(store, lora)), prefix="transformer",
                                       use_safetensors=True)
    assert any("lora_A" in n for n, _ in pipe.transformer.named_parameters())
    assert json.loads((Path(plan.model_dir) / "transformer" / "config.json").read_text())["task_type"] == "i2v"


def test_checkpoint_samples_and_the_validation_loss_read_the_condition(clips):
    """Samples during training render from the prompt's --i image; a held-out clip is scored with its own
    condition beside it (tasks/training/validation_loss.py), through this adapter's training_loss."""
    from tasks import train

    cfg = _cfg(clips, "sample.every_n_steps=2", "data.validation_split=0.5")
    store, run_dir = Store(clips / "store"), clips / "run"
    plan = validate.run(cfg, store)
    assert len(plan.validation_items) == 1
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, lat["items"], txt["items"], run_dir=run_dir)
    (step,) = sorted((run_dir / "samples").glob("step_*"))
    (video,) = step.glob("*.mp4")
    assert inspect_clip(video)[1].frames == 9
    assert lora["validation_loss"] and all(v["loss"] > 0 for v in lora["validation_loss"])

def test_lora_memorises_its_clip_from_its_first_frame(tmp_path):
    """bench/learns.py's check for `tiny_hunyuan_video15_i2v`: one 9-frame clip memorised from its first frame,
    rendered by HunyuanVideo15ImageToVideoPipeline from that frame with the diffusers file (the transformer's
    loader) and with the kohya file merged by ComfyUI's rule, each within the bound; a halved scale is caught."""
    from bench import learns
    from learning import FILES, learns_within_bound

    base, files, r = learns_within_bound(MODEL, tmp_path)
    assert r["loaders"]["kohya"] == "merge"
    bad = tmp_path / "halved.safetensors"
    FILES["scale_halved"](files["diffusers"], bad)
    assert learns.evaluate(MODEL, base, {"diffusers": bad})["files"]["diffusers"] > learns.BOUND
