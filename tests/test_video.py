"""Issue 33: video LoRAs on Wan 2.1 (`model=tiny_wan`), at the node functions (no Prefect): real mp4 clips written
and read with PyAV, real WanPipeline parts.

- Clips as data: same-stem captions, images mixed in as one-frame videos, data.frames on the VAE's 1 + 4k rule,
  data.fps resampling, frame buckets (a short clip trains at the frames it has); a broken clip is in the per-file
  report (error or skip), never a traceback; an image family notes clips and leaves them out.
- Cached per clip, by content (edit matrix rows, contract.md): one clip's bytes -> cache_latents 1, cache_text 0,
  train ran, sample all; data.frames -> the clips' latents, not the images'; a clip added -> 1 latent, 1 text.
- Samples are mp4 files (samples/ and samples/step_<k>/), a first-frame grid PNG, and TensorBoard's animated image.
- The LoRA files (diffusers; kohya = musubi-tuner's Wan names) load in WanPipeline.load_lora_weights with the same
  delta; the kohya names are the ones ComfyUI maps for Wan (its generic `lora_unet_<model key>` rule).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks import cache_latents, cache_text, publish, sample, train, validate
from tasks.config import ConfigError, compose, resolve_paths
from tasks.data.clips import inspect_clip, read_frames
from tasks.data.dataset import DatasetError
from tasks.store import Store
from support import box_clip, run_nodes  # validate, both caches, train, sample

REPO = Path(__file__).resolve().parents[1]
FPS = 8


def _clip(path: Path, n: int, color, fps: float = FPS) -> Path:
    return box_clip(path, n, color, fps)


@pytest.fixture
def clips(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _clip(data / "red.mp4", 12, (255, 0, 0))  # 12 frames: trains at 9 (data.frames=9)
    _clip(data / "green.mp4", 6, (0, 255, 0))  # 6 frames: its bucket is 5
    shutil.copyfile(REPO / "data" / "demo" / "img_00.png", data / "still.png")  # an image: one frame
    for stem, caption in (("red", "a red box moving right"), ("green", "a green box moving right"),
                          ("still", "a red circle on a blue background")):
        (data / f"{stem}.txt").write_text(caption + "\n")
    (tmp_path / "prompts.txt").write_text("a red box moving right\na green box --f 5\n")
    return tmp_path


def _cfg(root, *extra, model="tiny_wan"):
    return resolve_paths(compose("train", [
        f"model={model}", f"data.dir={root / 'data'}", f"store.root={root / 'store'}", "data.resolution=32",
        "data.frames=9", f"sample.prompts_file={root / 'prompts.txt'}", "train.max_steps=2", "train.batch_size=1",
        "train.log_with=none", "sample.steps=2", *extra])[0])


def test_plan_frames_buckets_and_latent_shapes(clips):
    cfg, store = _cfg(clips), Store(clips / "store")
    plan = validate.run(cfg, store)
    items = {it["name"]: it for it in plan.items}
    assert items["red.mp4"]["clip"] == {"frames": 9, "fps": float(FPS)}  # data.frames of its 12
    assert items["green.mp4"]["clip"] == {"frames": 5, "fps": float(FPS)}  # 6 frames: the 1 + 4k below
    assert "clip" not in items["still.png"]
    assert plan.video == {"frames": 9, "fps": 16.0}  # samples: data.frames at Wan's native rate
    lat = cache_latents.run(cfg, plan, store)
    shapes = {n: tuple(store.tensor_shapes(cache_latents.KIND, k)["latents"]) for n, k in lat["items"].items()}
    # Wan's VAE: 16 channels, 1 + (F - 1) / 4 latent frames, /8 in space
    assert shapes == {"red.mp4": (16, 3, 4, 4), "green.mp4": (16, 2, 4, 4), "still.png": (16, 1, 4, 4)}
    # the latent is the VAE's of the decoded frames (normalised per channel), not of anything else
    from tasks.models import make_adapter

    adapter = make_adapter(cfg.model, Path(plan.model_dir))
    # 40x40 frames: covering 32x32 is a plain bicubic resize (PIL's, as the image path), no crop
    frames = [Image.fromarray(f).resize((32, 32), Image.Resampling.BICUBIC)
              for f in read_frames(clips / "data" / "red.mp4", 9, FPS)]
    pixels = torch.stack([torch.from_numpy(np.asarray(f, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
                          for f in frames], dim=1)[None]
    direct = adapter.encode_latents(adapter.load_vae(), pixels)[0]
    stored = store.get_tensors(cache_latents.KIND, lat["items"]["red.mp4"])["latents"]
    assert torch.equal(stored, direct)  # the same input through the same VAE on this machine: the same bytes


def test_fps_resamples_and_is_in_the_key(clips):
    store = Store(clips / "store")
    plan = validate.run(_cfg(clips, "data.fps=4"), store)
    red = next(it for it in plan.items if it["name"] == "red.mp4")
    assert red["clip"] == {"frames": 5, "fps": 4.0}  # 12 frames at 8 fps = 1.5 s: 6 at 4 fps -> 5
    keys = cache_latents.item_keys(_cfg(clips, "data.fps=4"), plan)
    keys8 = cache_latents.item_keys(_cfg(clips), validate.run(_cfg(clips), store))
    assert keys["red.mp4"] != keys8["red.mp4"] and keys["still.png"] == keys8["still.png"]


def test_edit_matrix_rows_for_clips(clips):
    cfg, store = _cfg(clips), Store(clips / "store")
    _, lat, txt, lora, smp = run_nodes(cfg, store)
    # one clip's bytes (re-encoded: a brighter box) -> that latent alone, no text, train ran, sample all
    _clip(clips / "data" / "red.mp4", 12, (255, 80, 80))
    _, lat2, txt2, lora2, smp2 = run_nodes(cfg, store)
    assert (lat2["computed"], txt2["computed"], smp2["computed"]) == (1, 0, 2) and lora2["key"] != lora["key"]
    assert {n for n in lat["items"] if lat["items"][n] != lat2["items"][n]} == {"red.mp4"}
    # data.frames: the clips' latents (their frames change), never an image's
    plan3 = validate.run(_cfg(clips, "data.frames=5"), store)
    lat3 = cache_latents.run(_cfg(clips, "data.frames=5"), plan3, store)
    assert lat3["computed"] == 1 and lat3["items"]["still.png"] == lat2["items"]["still.png"]
    assert lat3["items"]["green.mp4"] == lat2["items"]["green.mp4"]  # 6 frames trained at 5 either way
    # a clip + caption added -> one latent, one text
    _clip(clips / "data" / "blue.mp4", 9, (0, 0, 255))
    (clips / "data" / "blue.txt").write_text("a blue box moving right\n")
    plan4 = validate.run(cfg, store)
    assert (cache_latents.run(cfg, plan4, store)["computed"], cache_text.run(cfg, plan4, store)["computed"]) == (1, 1)


def test_samples_are_mp4_with_a_grid_and_tensorboard_gets_them(clips):
    cfg = _cfg(clips, "sample.every_n_steps=2", "train.log_with=tensorboard")
    store, run_dir = Store(clips / "store"), clips / "run"
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, lat["items"], txt["items"], run_dir=run_dir)
    smp = sample.run(cfg, plan, store, lora["key"], lora["lora"], txt["items"])
    art = publish.publish(cfg, plan, store, run_dir, lora, smp["samples"])
    assert [Path(p).name for p in art["samples"]] == ["001_a_red_box_moving_right.mp4", "002_a_green_box.mp4"]
    got = {Path(p).name: inspect_clip(p)[1] for p in art["samples"]}
    assert got["001_a_red_box_moving_right.mp4"].frames == 9 and got["002_a_green_box.mp4"].frames == 5  # --f 5
    assert got["002_a_green_box.mp4"].fps == 16 and (got["002_a_green_box.mp4"].width, got["002_a_green_box.mp4"].height) == (32, 32)
    grid = Image.open(art["grid"])
    cell = 32 * -(-sample.GRID_CELL // 32)  # the two first frames side by side, enlarged under their labels
    assert grid.size == (2 * cell, cell + 4 + 12 * sample.LABEL_LINES)
    assert [Path(p).suffix for p in art["checkpoint_samples"]["2"]] == [".mp4", ".mp4"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = {f.parent for f in (run_dir / "tensorboard").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(min(folders)), size_guidance={"images": 0})  # accelerate's run folder
    events.Reload()
    tags = [t for t in events.Tags()["images"] if t.startswith("samples/")]
    assert len(tags) == 2
    gif = events.Images(tags[0])[0].encoded_image_string
    assert gif[:6] == b"GIF89a" and Image.open(__import__("io").BytesIO(gif)).n_frames == 9


def test_lora_files_load_in_wanpipeline_with_the_same_delta(clips):
    cfg, store = _cfg(clips, "export.format=both"), Store(clips / "store")
    plan, _, _, lora, _ = run_nodes(cfg, store)
    files = {"diffusers": publish.diffusers_file(store, lora), "kohya": publish.kohya_file(cfg, plan, store, lora)}
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    names = sorted(k.split(".")[0] for k in load_file(str(files["kohya"])) if k.endswith(".alpha"))
    # musubi-tuner's Wan names (networks/lora_wan.py), which diffusers' _convert_musubi_wan_lora_to_diffusers
    # reads and ComfyUI maps by model_lora_keys_unet's `lora_unet_<its Wan model key, dots as _>`
    assert names[:10] == [f"lora_unet_blocks_0_{m}" for m in ("cross_attn_k", "cross_attn_o", "cross_attn_q",
                          "cross_attn_v", "ffn_0", "ffn_2", "self_attn_k", "self_attn_o", "self_attn_q", "self_attn_v")]
    pipe = WanPipeline.from_pretrained(plan.model_dir, use_safetensors=True)
    for name, file in files.items():
        pipe.load_lora_weights(str(file), adapter_name=name)
    sd = pipe.transformer.state_dict()
    for module in ("blocks.0.attn1.to_q", "blocks.1.attn2.to_out.0", "blocks.1.ffn.net.0.proj"):
        d, k = (sd[f"{module}.lora_B.{n}.weight"] @ sd[f"{module}.lora_A.{n}.weight"] for n in ("diffusers", "kohya"))
        # the converter folds alpha/rank (1 here: alpha = rank) into the weights as a power of two: exact
        assert torch.equal(d, k) and d.abs().max() > 0


def test_broken_clip_is_reported_not_raised(clips):
    (clips / "data" / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    (clips / "data" / "bad.txt").write_text("broken\n")
    with pytest.raises(DatasetError, match=r"bad\.mp4: cannot decode video"):
        validate.run(_cfg(clips), Store(clips / "store"))
    plan = validate.run(_cfg(clips, "data.bad_files=skip"), Store(clips / "store"))
    assert "bad.mp4" not in {it["name"] for it in plan.items}
    assert any(f["file"] == "bad.mp4" and f["policy"] == "skipped" for f in plan.dataset)


def test_image_family_notes_clips_and_trains_the_images(clips):
    plan = validate.run(_cfg(clips, model="tiny_flux"), Store(clips / "store"))
    assert [it["name"] for it in plan.items] == ["still.png"]
    assert {f["file"]: f["policy"] for f in plan.dataset} == {"green.mp4": "ignored", "red.mp4": "ignored"}


@pytest.mark.parametrize("override, says", [
    ("data.frames=8", "data.frames=8: wan's video VAE takes 1 + 4k frames; use data.frames=5 or data.frames=9"),
    ("data.fps=0", "data.fps=0"),
    ("data.alpha_mask=true", "data.alpha_mask: not available for video families yet"),
])
def test_config_errors_name_the_key(clips, override, says):
    with pytest.raises(ConfigError, match=says.replace("+", r"\+").replace(".", r"\.")):
        validate.run(_cfg(clips, override), Store(clips / "store"))


def test_f_option_parses():
    from tasks.data.prompts import parse_prompt_line

    assert parse_prompt_line("a clip --f 17 --w 64", 1).frames == 17


# -- it learns (bench/learns.py's check, issue 33 item 5) -----------------------------------------------------------


@pytest.fixture(scope="module")
def wan_learned(tmp_path_factory):
    from bench import learns

    root = tmp_path_factory.mktemp("tiny_wan")
    learns.dataset(root, "tiny_wan")
    base, files = learns.train_nodes("tiny_wan", root)
    return base, files, learns.evaluate("tiny_wan", base, files)


def test_wan_lora_memorises_its_clip(wan_learned):
    """One 9-frame clip memorised; WanPipeline with each exported file renders it from noise (the latent handed
    to vae.decode vs the clip's own VAE latent) within the image families' bound. Deterministic on the AVX2
    kernels `make test` uses (bench/learns.json: 0.095)."""
    from bench import learns

    _, _, r = wan_learned
    assert set(r["files"]) == {"diffusers", "kohya"} and set(r["loaders"].values()) == {"load_lora_weights"}
    for fmt, ratio in r["files"].items():
        assert ratio <= learns.bound("tiny_wan"), f"tiny_wan {fmt}: err ratio {ratio:.4f} > {learns.bound('tiny_wan')}"


def test_wan_check_catches_a_halved_scale_and_a_flipped_target(wan_learned, monkeypatch, tmp_path):
    from bench import learns
    from learning import FILES, sign_flipped

    base, files, _ = wan_learned
    bad = tmp_path / files["kohya"].name
    FILES["scale_halved"](files["kohya"], bad)
    assert learns.evaluate("tiny_wan", base, {"kohya": bad})["files"]["kohya"] > learns.BOUND
    sign_flipped(monkeypatch, "wan")  # the velocity target's sign: a falling loss, a wrong LoRA
    learns.dataset(tmp_path / "flipped", "tiny_wan")
    base2, files2 = learns.train_nodes("tiny_wan", tmp_path / "flipped")
    monkeypatch.undo()
    assert learns.evaluate("tiny_wan", base2, files2)["ratio"] > learns.BOUND


def test_wan_kohya_file_is_mapped_completely_by_comfyui(tmp_path):
    """ComfyUI's Wan model keeps Wan's original module names (comfy/ldm/wan/model.py: blocks.N.self_attn.q|k|v|o,
    cross_attn.q|k|v|o, ffn.0 / ffn.2, as Wan's own wan/modules/model.py); restated here from diffusers' table of
    the same names (loaders/lora_conversion_utils.py `_convert_non_diffusers_wan_lora_to_diffusers`: self_attn ->
    attn1, cross_attn -> attn2, q/k/v/o -> to_q/to_k/to_v/to_out.0, ffn.0 -> ffn.net.0.proj, ffn.2 -> ffn.net.2).
    model_lora_keys_unet's generic rule maps `lora_unet_<key, dots as _>` to each (tests/test_comfyui_keys.py
    restates it with its commit); every key of the kohya file (= the ComfyUI file) must be read and merge to the
    PEFT LoRA's delta."""
    from lora_fixtures import random_lora
    from support import REL
    from support import comfyui_merge

    from tasks.models.tiny.tiny_wan import build_tiny_wan
    from tasks.models.wan import WanAdapter
    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya

    build_tiny_wan(tmp_path / "wan")
    adapter = WanAdapter(tmp_path / "wan")
    den = adapter.load_denoiser()
    linears = {n: m for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}  # before peft wraps them
    sd, _ = random_lora(den, adapter.default_lora_targets(), 4, 8)
    comfy_name = {"attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v",
                  "to_out.0": "o", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}

    def original(name: str) -> str:
        for d, o in comfy_name.items():
            name = name.replace(f".{d}", f".{o}")
        return name

    comfy_keys = {original(n): (m.out_features, m.in_features) for n, m in linears.items()}
    file = to_kohya("wan", sd, 4, 8)
    merged = comfyui_merge("wan", file, comfy_keys)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert {original(m) for m in modules} == set(merged) and len(merged) == 20  # 10 Linears x 2 blocks
    for m in modules:
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[original(m)] - want).abs().max() <= REL * want.abs().max(), m
    assert comfyui_loads_kohya("wan") and comfyui_loads_kohya("wan22")
