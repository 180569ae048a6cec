"""Issue 47: image-to-video LoRAs (`model=tiny_wan_i2v|tiny_wan22_i2v|tiny_wan22_ti2v`), at the node functions and
against diffusers' own WanImageToVideoPipeline (real mp4 clips, real pipeline parts):

- the transformer is fed as the pipeline feeds it: the same condition channels (mask + first-frame latent), the
  same CLIP image states (Wan 2.1), TI2V-5B's clean first frame at timestep 0;
- the condition is an artifact like the others: cached per clip, keyed by what it is taken from (edit matrix rows:
  a clip's first frame -> its latent, its condition and train; a caption -> not the condition);
- data.condition_image=beside takes a same-stem image; the bad inputs get one line each (exit 2 at the CLI);
- samples render from `--i` to mp4; the files load in WanImageToVideoPipeline and map in ComfyUI.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from tasks import cache_latents, publish, validate
from tasks.config import ConfigError, compose, resolve_paths
from tasks.data.clips import inspect_clip, read_frames
from tasks.models import make_adapter
from tasks.store import Store
from conftest import cli_env
from support import box_clip, run_nodes

REPO = Path(__file__).resolve().parents[1]
FPS = 8
I2V = ("tiny_wan_i2v", "tiny_wan22_i2v", "tiny_wan22_ti2v")


def _clip(path: Path, n: int, color, first=None, fps: float = FPS) -> Path:
    return box_clip(path, n, color, fps, first)


@pytest.fixture
def clips(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _clip(data / "red.mp4", 12, (255, 0, 0))
    _clip(data / "green.mp4", 9, (0, 255, 0))
    shutil.copyfile(REPO / "data" / "demo" / "img_00.png", data / "still.png")  # an image: not an I2V item
    for stem, caption in (("red", "a red box moving right"), ("green", "a green box moving right"),
                          ("still", "a red circle on a blue background")):
        (data / f"{stem}.txt").write_text(caption + "\n")
    Image.fromarray(read_frames(data / "red.mp4", 1)[0]).save(tmp_path / "first.png")
    (tmp_path / "prompts.txt").write_text("a red box moving right --i first.png\n")
    return tmp_path


def _cfg(root, *extra, model="tiny_wan_i2v"):
    return resolve_paths(compose("train", [
        f"model={model}", f"data.dir={root / 'data'}", f"store.root={root / 'store'}", "data.resolution=32",
        "data.frames=9", f"sample.prompts_file={root / 'prompts.txt'}", "train.max_steps=2", "train.batch_size=1",
        "train.log_with=none", "sample.steps=2", *extra])[0])


# -- the transformer is fed as WanImageToVideoPipeline feeds it ---------------------------------------------------


def _spy(model) -> list[dict]:
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls


@pytest.mark.parametrize("model", I2V)
def test_the_condition_is_the_pipelines(clips, model):
    """The condition loraflow caches and trains with is what the pipeline builds from the same first frame:
    prepare_latents' condition (mask + zero-padded first-frame latent; TI2V: the first frame alone) and, for
    Wan 2.1, encode_image's CLIP states. Exact where the same ops run on the same input; the latent's one
    difference is the normalisation, (z - mean) / std here and (z - mean) * (1 / std) there: one rounding of
    each, so at most 2 float32 ulps of the result (2 * 2^-23 relative) apart, bounded here by 4 * eps * max |z|."""
    cfg, store = _cfg(clips, model=model), Store(clips / "store")
    plan = validate.run(cfg, store)
    lat = cache_latents.run(cfg, plan, store)
    stored = store.get_tensors(cache_latents.KIND, lat["items"]["control:red.mp4:0"])
    adapter = make_adapter(cfg.model, Path(plan.model_dir))
    pipe = adapter.pipeline_cls.from_pretrained(plan.model_dir, use_safetensors=True, text_encoder=None, tokenizer=None)
    first = Image.fromarray(read_frames(clips / "data" / "red.mp4", 1, FPS)[0]).resize((32, 32), Image.Resampling.BICUBIC)
    image = pipe.video_processor.preprocess(first, height=32, width=32)
    out = pipe.prepare_latents(image, 1, pipe.vae.config.z_dim, 32, 32, 9, torch.float32, "cpu",
                               torch.Generator().manual_seed(0))
    cond = out[1]  # [1, C, F', h, w]: mask + latent, or (TI2V) the first frame's latent
    assert stored["latents"].shape == cond.shape[1:]
    tol = 4 * torch.finfo(torch.float32).eps * cond.abs().max()
    assert (stored["latents"] - cond[0]).abs().max() <= tol
    if model == "tiny_wan_i2v":
        assert torch.equal(stored["image_embeds"], pipe.encode_image(first, "cpu")[0])
    else:
        assert set(stored) == {"latents"}


def test_ti2v_trains_the_frames_after_a_clean_first_frame(clips):
    """TI2V-5B as its pipeline's loop: the first latent frame of the input is the condition, its tokens at
    timestep 0, the others at t; the loss leaves the first frame's prediction out (the pipeline discards it)."""
    cfg, store = _cfg(clips, model="tiny_wan22_ti2v"), Store(clips / "store")
    plan = validate.run(cfg, store)
    lat = cache_latents.run(cfg, plan, store)
    adapter = make_adapter(cfg.model, Path(plan.model_dir))
    latents = store.get_tensors(cache_latents.KIND, lat["items"]["red.mp4"])["latents"][None]
    cond = store.get_tensors(cache_latents.KIND, lat["items"]["control:red.mp4:0"])["latents"]
    denoiser = adapter.load_denoiser()
    calls = _spy(denoiser)
    text = {"prompt_embeds": torch.zeros(1, 32, 32), "control_latents": cond[None, None]}
    loss = adapter.training_loss(denoiser, latents, text, cfg.train, adapter.load_train_scheduler(),
                                 [torch.Generator().manual_seed(1)])
    (call,) = calls
    assert torch.equal(call["hidden_states"][:, :, :1], cond[None])
    per_frame = (latents.shape[3] // 2) * (latents.shape[4] // 2)
    t = call["timestep"]
    assert t.shape == (1, latents.shape[2] * per_frame) and (t[:, :per_frame] == 0).all()
    assert (t[:, per_frame:] == t[0, -1]).all() and t[0, -1] > 0
    assert torch.isfinite(loss)


# -- an artifact like the others -----------------------------------------------------------------------------------


def test_plan_cache_and_samples_of_a_first_frame_run(clips):
    cfg, store = _cfg(clips), Store(clips / "store")
    plan, lat, txt, lora, smp = run_nodes(cfg, store)
    items = {it["name"]: it for it in plan.items}
    assert set(items) == {"red.mp4", "green.mp4"}  # the still image is noted, not trained
    assert {f["file"]: f["policy"] for f in plan.dataset} == {"still.png": "ignored"}
    assert items["red.mp4"]["controls"][0][0] == str(clips / "data" / "red.mp4")
    assert set(lat["items"]) == {"red.mp4", "green.mp4", "control:red.mp4:0", "control:green.mp4:0"}
    shapes = store.tensor_shapes(cache_latents.KIND, lat["items"]["control:red.mp4:0"])
    assert tuple(shapes["latents"]) == (20, 3, 4, 4) and tuple(shapes["image_embeds"]) == (17, 16)
    (file,) = [Path(p) for p in smp["samples"]]  # rendered from --i first.png
    assert file.suffix == ".mp4" and inspect_clip(file)[1].frames == 9


def test_edit_matrix_first_frame_and_caption(clips):
    cfg, store = _cfg(clips), Store(clips / "store")
    _, lat, txt, lora, _ = run_nodes(cfg, store)
    # one clip's first frame: its latent and its condition, nothing else; train ran
    _clip(clips / "data" / "red.mp4", 12, (255, 0, 0), first=(0, 0, 255))
    _, lat2, txt2, lora2, _ = run_nodes(cfg, store)
    assert (lat2["computed"], txt2["computed"]) == (2, 0) and lora2["key"] != lora["key"]
    assert {n for n in lat["items"] if lat["items"][n] != lat2["items"][n]} == {"red.mp4", "control:red.mp4:0"}
    # a caption: its text and train, not the condition
    (clips / "data" / "green.txt").write_text("a green box sliding right\n")
    _, lat3, txt3, lora3, _ = run_nodes(cfg, store)
    assert (lat3["computed"], txt3["computed"]) == (0, 1) and lora3["key"] != lora2["key"]


def test_condition_image_beside_the_clip(clips):
    data = clips / "data"
    Image.new("RGB", (40, 40), (200, 0, 200)).save(data / "red.png")
    Image.new("RGB", (40, 40), (0, 200, 200)).save(data / "green.png")
    cfg, store = _cfg(clips, "data.condition_image=beside"), Store(clips / "store")
    plan = validate.run(cfg, store)
    items = {it["name"]: it for it in plan.items}
    assert items["red.mp4"]["controls"][0][0] == str(data / "red.png")
    assert {f["file"] for f in plan.dataset} == {"red.png", "green.png", "still.png"}  # conditions, and an image
    keys = cache_latents.item_keys(cfg, plan)
    first = cache_latents.item_keys(_cfg(clips), validate.run(_cfg(clips), store))
    assert keys["control:red.mp4:0"] != first["control:red.mp4:0"] and keys["red.mp4"] == first["red.mp4"]
    Image.new("RGB", (40, 40), (10, 10, 10)).save(data / "red.png")  # a new condition image: its key alone
    keys2 = cache_latents.item_keys(cfg, validate.run(cfg, store))
    assert {n for n in keys if keys[n] != keys2[n]} == {"control:red.mp4:0"}


@pytest.mark.parametrize("change, override, says", [
    ("short", (), r"green\.mp4: 5 frame\(s\) at 8 fps where data\.frames=9"),
    ("size", ("data.condition_image=beside",), r"red\.mp4: condition image red\.png is 20x40, the clip 40x40"),
    ("missing", ("data.condition_image=beside",), r"green\.mp4: no condition image green\.png"),
    ("t2v", ("model=tiny_wan", "data.condition_image=beside"), r"data\.condition_image=beside: model\.family=wan is not"),
    ("no_i", (), r"prompts\.txt:1: model\.family=wan_i2v renders a clip from its first frame: give it one with --i"),
])
def test_bad_input_is_one_clear_error(clips, change, override, says):
    data = clips / "data"
    if change == "short":
        _clip(data / "green.mp4", 6, (0, 255, 0))
    if change in ("size", "missing"):
        Image.new("RGB", (20, 40), (200, 0, 200)).save(data / "red.png")
    if change == "no_i":
        (clips / "prompts.txt").write_text("a red box moving right\n")
    with pytest.raises(ConfigError, match=says):
        validate.run(_cfg(clips, *override), Store(clips / "store"))


def test_cli_says_one_line_and_exits_2(clips):
    _clip(clips / "data" / "green.mp4", 6, (0, 255, 0))
    env = cli_env(clips / "prefect")
    done = subprocess.run([sys.executable, "-m", "flows.train", "model=tiny_wan_i2v", f"data.dir={clips / 'data'}",
                           f"store.root={clips / 'store'}", "data.frames=9", "data.resolution=32",
                           f"sample.prompts_file={clips / 'prompts.txt'}", f"hydra.run.dir={clips / 'run'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "green.mp4: 5 frame(s) at 8 fps where data.frames=9" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


# -- files load where video users load them ------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny_wan_i2v", "tiny_wan22_ti2v"])
def test_files_load_in_the_i2v_pipeline_with_the_same_delta(clips, model):
    cfg, store = _cfg(clips, "export.format=both", model=model), Store(clips / "store")
    plan, _, _, lora, _ = run_nodes(cfg, store)
    files = {"diffusers": publish.diffusers_file(store, lora), "kohya": publish.kohya_file(cfg, plan, store, lora)}
    from diffusers import WanImageToVideoPipeline
    from safetensors.torch import load_file

    kohya = load_file(str(files["kohya"]))
    if model == "tiny_wan_i2v":  # the image key/value Linears, in musubi-tuner's Wan names (k_img, v_img)
        assert {"lora_unet_blocks_0_cross_attn_k_img.alpha", "lora_unet_blocks_1_cross_attn_v_img.alpha"} <= set(kohya)
    pipe = WanImageToVideoPipeline.from_pretrained(plan.model_dir, use_safetensors=True)
    for name, file in files.items():
        pipe.load_lora_weights(str(file), adapter_name=name)
    sd = pipe.transformer.state_dict()
    modules = ["blocks.0.attn1.to_q", "blocks.1.ffn.net.0.proj"] + (
        ["blocks.0.attn2.add_k_proj", "blocks.1.attn2.add_v_proj"] if model == "tiny_wan_i2v" else [])
    for module in modules:
        d, k = (sd[f"{module}.lora_B.{n}.weight"] @ sd[f"{module}.lora_A.{n}.weight"] for n in ("diffusers", "kohya"))
        assert torch.equal(d, k) and d.abs().max() > 0, module  # alpha = rank: the converter's scale is exactly 1


@pytest.mark.parametrize("family", ["wan_i2v", "wan22_i2v", "wan22_ti2v"])
def test_kohya_file_is_mapped_completely_by_comfyui(tmp_path, family):
    """ComfyUI's Wan model (comfy/ldm/wan/model.py) names the image key/value Linears cross_attn.k_img / v_img, as
    Wan's own WanI2VCrossAttention; the generic `lora_unet_<key>` rule maps every key of the kohya file, which
    merges to the PEFT LoRA's delta (support.REL: float64 products, float32 factors)."""
    from lora_fixtures import random_lora
    from support import REL, comfyui_merge

    from tasks.models import FAMILIES, adapter_class
    from tasks.models.tiny import tiny_wan_i2v
    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya

    getattr(tiny_wan_i2v, FAMILIES[family][1].split(":")[1])(tmp_path / "m")
    adapter = adapter_class(family)(tmp_path / "m")
    den = adapter.load_denoiser()
    linears = {n: m for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}
    sd, _ = random_lora(den, adapter.default_lora_targets(), 4, 8)
    comfy_name = {"attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v",
                  "to_out.0": "o", "add_k_proj": "k_img", "add_v_proj": "v_img", "ffn.net.0.proj": "ffn.0",
                  "ffn.net.2": "ffn.2"}

    def original(name: str) -> str:
        for d, o in comfy_name.items():
            name = name.replace(f".{d}", f".{o}")
        return name

    comfy_keys = {original(n): (m.out_features, m.in_features) for n, m in linears.items()}
    merged = comfyui_merge(family, to_kohya(family, sd, 4, 8), comfy_keys)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    # 10 Linears a block (12 with Wan 2.1's image key/value) x 2 blocks
    assert {original(m) for m in modules} == set(merged) and len(merged) == (24 if family == "wan_i2v" else 20)
    for m in modules:
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[original(m)] - want).abs().max() <= REL * want.abs().max(), m
    assert comfyui_loads_kohya(family)
