"""Issue 31: Qwen-Image-Edit-Plus (`model=tiny_qwenimage_edit`), whose text encoder sees the control images, at
the node functions (2 demo images at 32 px; no Prefect).

- The tiny model is the real pipeline's layout: its tokenizer drops the edit template's 64 tokens as the real
  one does, and each control image becomes the Qwen2-VL processor's merged-patch tokens in the text.
- Edit matrix (contract.md): one control image's bytes -> cache_latents 1, cache_text 1 (that pair's caption,
  which sees the image), train ran, sample all; a second control dir -> its latents and every caption.
- Controls are encoded as the pipeline resizes them (about 1 MP for the VAE); a sample prompt's texts are keyed
  by its --i images; the LoRA files load in `QwenImageEditPlusPipeline.load_lora_weights` and change its output.
- Refusals: no control dir, a sample prompt without --i, data.flip_aug, a text over max_sequence_length.
- It learns: the learning check on one pair (here rather than in tests/test_learns.py: the slowest check).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tasks import cache_latents, cache_text, publish, validate
from tasks.config import ConfigError, compose, resolve_paths
from tasks.data import controls
from tasks.models import make_adapter
from tasks.models.qwenimage_edit import QwenImageEditAdapter, vision_text_processor
from tasks.store import Store
from tasks.training.export import to_kohya
from support import run_nodes  # validate, both caches, train, sample

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pairs(tmp_path):
    for d in ("data", "ctrl", "ctrl2"):
        (tmp_path / d).mkdir()
    for i in range(2):
        for ext in (".png", ".txt"):
            shutil.copyfile(REPO / "data" / "demo" / f"img_{i:02d}{ext}", tmp_path / "data" / f"img_{i:02d}{ext}")
        img = Image.open(tmp_path / "data" / f"img_{i:02d}.png").convert("RGB")
        ImageOps.invert(img).save(tmp_path / "ctrl" / f"img_{i:02d}.png")
        ImageOps.mirror(img).save(tmp_path / "ctrl2" / f"img_{i:02d}.png")
    (tmp_path / "prompts.txt").write_text("a red circle --i ctrl/img_00.png\nmake it blue --i ctrl/img_01.png\n")
    return tmp_path


@pytest.fixture
def quarter_mp_controls(monkeypatch):
    """Controls at 256x256 instead of the pipeline's ~1 MP (VAE_IMAGE_SIZE): 256 control tokens beside the
    target's 4 instead of 4096, for the tests of what the size does not change (the edit matrix, the loss seeing
    the control, the files loading). The adapter's control_size and the pipeline read the module constant when
    they run, so it is the same chain; the 1 MP itself: test_controls_at_the_pipelines_size and
    test_a_control_with_its_targets_bytes_is_its_own_latent."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 256 * 256)


def _cfg(root, *extra, dirs=("ctrl",)):
    return resolve_paths(compose("train", [
        "model=tiny_qwenimage_edit", f"data.dir={root / 'data'}", f"store.root={root / 'store'}", "data.resolution=32",
        f"sample.prompts_file={root / 'prompts.txt'}", "train.max_steps=2", "train.batch_size=2", "train.log_with=none",
        "sample.steps=2", f"data.control_dirs=[{','.join(str(root / d) for d in dirs)}]", *extra])[0])


def test_template_and_vision_tokens(pairs):
    store = Store(pairs / "store")
    plan = validate.run(_cfg(pairs), store)
    adapter = make_adapter(_cfg(pairs).model, plan.model_dir)
    pipe = adapter.load_text_encoders()
    # the real tokenizer makes the edit template's system turn 64 tokens, which the pipeline drops
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix)["input_ids"]) == pipe.prompt_template_encode_start_idx == 64
    # a 384x384 condition image: 28x28 patches of 14 px, merged 2x2 -> 196 image tokens (Qwen2VLProcessor's rule)
    proc = vision_text_processor(plan.model_dir)
    out = proc(text=["Picture 1: <|vision_start|><|image_pad|><|vision_end|>x"], images=[Image.new("RGB", (384, 384))])
    assert out["image_grid_thw"].tolist() == [[1, 28, 28]]
    assert (out["input_ids"] == pipe.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum() == 196
    # the caption's embedding sees the image: another control, another embedding; the text's length counts it
    red, blue = Image.new("RGB", (32, 32), "red"), Image.new("RGB", (32, 32), "blue")
    a, b, none = adapter.encode_text(pipe, ["a cat"] * 3, images=[[red], [blue], []])
    assert not torch.equal(a["prompt_embeds"], b["prompt_embeds"])
    assert int(a["attention_mask"].sum()) > 196 > int(none["attention_mask"].sum())


def test_controls_at_the_pipelines_size():
    # QwenImageEditPlusPipeline's VAE_IMAGE_SIZE (1024 * 1024) at the target's aspect, multiples of 32
    assert QwenImageEditAdapter.control_size(32, 32) == (1024, 1024)
    assert QwenImageEditAdapter.control_size(96, 64) == (1248, 832)


def test_edit_matrix_rows_and_samples(pairs, quarter_mp_controls):
    store = Store(pairs / "store")
    cfg = lambda dirs=("ctrl",): _cfg(pairs, "model.max_sequence_length=448", dirs=dirs)  # noqa: E731 (2 controls: 420)
    plan, lat, txt, lora, smp = run_nodes(cfg(), store)
    control = store.get_tensors(cache_latents.KIND, lat["items"][controls.item_name("img_00.png", 0)])["latents"]
    assert control.shape[-2:] == (32, 32)  # 256 px / 8: the pipeline's control size (patched), not the target's 32 px
    assert "empty:prompt:1" in txt["items"]  # the true-CFG negative of a prompt with --i sees its images too
    edited = np.asarray(Image.open(smp["samples"][0]))
    assert edited.shape[1] == 2 * edited.shape[0]  # the control image beside the result

    im = Image.open(pairs / "ctrl" / "img_01.png")
    im.putpixel((0, 0), (1, 2, 3))
    im.save(pairs / "ctrl" / "img_01.png")  # one control image's bytes (and prompt 2's --i image)
    _, lat2, txt2, lora2, smp2 = run_nodes(cfg(), store)
    assert lat2["computed"] == 1 and lora2["computed"] == 1 and lora2["key"] != lora["key"]
    # the pair's caption (its encoder sees the image), and prompt 2's texts, which see the same file
    assert txt2["computed"] == 3 and txt2["items"]["caption:img_00.png"] == txt["items"]["caption:img_00.png"]
    assert txt2["items"]["prompt:1"] == txt["items"]["prompt:1"] and smp2["computed"] == 2  # sample: all

    _, lat3, txt3, lora3, _ = run_nodes(cfg(("ctrl", "ctrl2")), store)  # a second control dir
    assert (lat3["computed"], txt3["computed"], lora3["computed"]) == (2, 2, 1)  # its latents; both captions


def test_a_control_with_its_targets_bytes_is_its_own_latent(pairs):
    """The control's size is in its key: a control image byte-equal to its target (here every one) is encoded
    twice, at the target's 32 px and at the pipeline's ~1 MP, not once for both."""
    shutil.rmtree(pairs / "ctrl")
    shutil.copytree(pairs / "data", pairs / "ctrl")
    store = Store(pairs / "store")
    cfg = _cfg(pairs)
    lat = cache_latents.run(cfg, validate.run(cfg, store), store)
    target = store.get_tensors(cache_latents.KIND, lat["items"]["img_00.png"])["latents"]
    control = store.get_tensors(cache_latents.KIND, lat["items"][controls.item_name("img_00.png", 0)])["latents"]
    assert target.shape[-2:] == (4, 4) and control.shape[-2:] == (128, 128) and lat["computed"] == 4


def test_control_changes_the_loss(pairs, quarter_mp_controls):
    store = Store(pairs / "store")
    cfg = _cfg(pairs)
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    adapter = make_adapter(cfg.model, plan.model_dir)
    den = adapter.load_denoiser()
    target = store.get_tensors(cache_latents.KIND, lat["items"]["img_00.png"])["latents"][None]
    control = store.get_tensors(cache_latents.KIND, lat["items"][controls.item_name("img_00.png", 0)])["latents"]
    text = {k: v[None] for k, v in store.get_tensors(cache_text.KIND, txt["items"]["caption:img_00.png"]).items()}
    scheduler = adapter.load_train_scheduler()

    def loss(c):
        gens = [torch.Generator().manual_seed(0)]
        return adapter.training_loss(den, target, {**text, "control_latents": c}, cfg.train, scheduler, gens).item()

    with torch.no_grad():
        one, inverted, two = loss(control[None, None]), loss(-control[None, None]), loss(torch.stack([control, -control])[None])
    assert len({one, inverted, two}) == 3


def test_refusals(pairs):
    store = Store(pairs / "store")
    errors = validate.config_errors(_cfg(pairs, dirs=()))
    assert any("edits an image: set data.control_dirs=[DIR]" in e for e in errors)
    assert any("data.flip_aug with model.family=qwenimage_edit" in e
               for e in validate.config_errors(_cfg(pairs, "data.flip_aug=true")))
    assert any("at most 3" in e for e in validate.config_errors(_cfg(pairs, dirs=("ctrl",) * 4)))
    (pairs / "prompts.txt").write_text("no image here\n")
    with pytest.raises(ConfigError, match=r"prompts.txt:1: model.family=qwenimage_edit edits an image: give it one with --i"):
        validate.run(_cfg(pairs), store)
    (pairs / "prompts.txt").write_text("x --i ctrl/img_00.png\n")
    cfg = _cfg(pairs, "model.max_sequence_length=64")
    with pytest.raises(ConfigError, match=r"model.max_sequence_length=64: .* set model.max_sequence_length=2\d\d or more"):
        cache_text.run(cfg, validate.run(cfg, store), store)


def test_lora_files_load_in_the_edit_pipeline(pairs, quarter_mp_controls):
    from diffusers import QwenImageEditPlusPipeline

    store = Store(pairs / "store")
    cfg = _cfg(pairs, "train.lr=0.05")
    plan, lat, txt, lora, _ = run_nodes(cfg, store)
    files = publish.publish(cfg, plan, store, pairs / "run", lora, [])["lora_files"]
    control = Image.open(pairs / "ctrl" / "img_00.png").convert("RGB").resize((32, 32))

    def render(file):
        pipe = QwenImageEditPlusPipeline.from_pretrained(plan.model_dir, processor=None)
        pipe.processor = vision_text_processor(plan.model_dir)  # the real one needs torchvision
        if file:
            pipe.load_lora_weights(str(file))
        pipe.set_progress_bar_config(disable=True)
        return pipe(prompt="a red circle", image=[control], width=32, height=32, num_inference_steps=2,
                    output_type="np", generator=torch.Generator().manual_seed(0)).images[0]

    base = render(None)
    for fmt in ("diffusers", "kohya"):  # musubi-tuner's Qwen-Image names, which diffusers converts
        assert np.abs(render(files[fmt]) - base).max() > 0, fmt
    # ComfyUI loads Qwen-Image-Edit checkpoints as its QwenImage model (comfy/supported_models.py, QwenImage:
    # unet_config image_model "qwen_image"): the key map tests/test_comfyui_keys.py pins for qwenimage
    sd = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 4),
          "transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(4, 2)}
    assert to_kohya("qwenimage_edit", sd, 2, 2).keys() == to_kohya("qwenimage", sd, 2, 2).keys()


@pytest.mark.timeout(1800)  # generous: its outcome must not depend on the machine's load
def test_it_learns_one_pair(tmp_path, monkeypatch):
    """The learning check (bench/learns.py, tests/test_learns.py) for Qwen-Image-Edit: trained on one (control,
    target) pair, each exported file in QwenImageEditPlusPipeline given the control renders the target.

    The pipeline VAE-encodes a control at VAE_IMAGE_SIZE (1 MP: 4096 tokens beside the 64 px target's 16), which
    made this one test 10 minutes of the suite (2.5 alone). The adapter (control_size) and the pipeline read the
    same module constant when they run, so at 256x256 it is the same chain at a sixteenth of the tokens;
    `python -m bench.learns --only tiny_qwenimage_edit` runs it at the pipeline's own 1 MP."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus
    from learning import learns_within_bound

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 256 * 256)
    learns_within_bound("tiny_qwenimage_edit", tmp_path)
