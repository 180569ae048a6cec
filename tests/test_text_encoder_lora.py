"""train.text_encoder_lr (issue 22, item 3): a LoRA on SD1.5's / SDXL's text encoders too, in its own optimizer
group. Captions are encoded live with gradients (nothing from the text cache), checkpoints hold the encoders'
LoRA and optimizer state (resume is exact), the diffusers file holds `text_encoder(_2).*` keys and the kohya file
`lora_te_*` / `lora_te1_*` / `lora_te2_*`, both loading in diffusers to the same encoder outputs, and the sample
node renders with the trained encoders. Off (null), no key changes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from tasks import cache_latents, cache_text, publish, sample, train, validate
from tasks.training import checkpoints, train_key
from tasks.config import compose, resolve_paths, updated
from tasks.report import node_entry
from tasks.store import Store
from tolerance import assert_close, rounding, sums

TE = "train.text_encoder_lr=0.05"  # high, so a few steps change the encoders' outputs visibly
RUN = (TE, "train.save_every_n_steps=2", "sample.every_n_steps=2")  # the shared run: checkpoints, samples at 2, 4
PROMPT = "a red circle on a blue background"


def _cfg(*overrides):
    return resolve_paths(compose("train", list(overrides))[0])


def _run(root, *extra, family="sd15", samples=False):
    cfg = _cfg(f"store.root={root}", f"model=tiny_{family}", "train.batch_size=2", "train.max_steps=4",
               "train.log_with=none", "sample.steps=2", *extra)
    store = Store(root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, latents["items"], texts["items"])
    shots = sample.run(cfg, plan, store, lora["key"], lora["lora"], texts["items"]) if samples else None
    return {"cfg": cfg, "plan": plan, "store": store, "texts": texts, "lora": lora, "samples": shots}


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    """A TE-LoRA run of tiny SD1.5 (4 steps; checkpoints and samples at steps 2 and 4) with its samples."""
    return _run(tmp_path_factory.mktemp("te") / "store", *RUN, samples=True)


def test_config_refuses_bad_values_and_other_families():
    assert validate.config_errors(_cfg("model=tiny_sd15", TE)) == []
    assert validate.config_errors(_cfg("model=tiny_sdxl", TE)) == []
    for bad in ("0", "-1e-4", "nan", "inf"):
        errors = validate.config_errors(_cfg("model=tiny_sd15", f"train.text_encoder_lr={bad}"))
        assert errors and all(e.startswith("train.text_encoder_lr=") for e in errors), (bad, errors)
        assert "or null" in errors[0]
    for family in ("flux", "sd3", "zimage", "qwenimage", "flux2_klein"):
        errors = validate.config_errors(_cfg(f"model=tiny_{family}", TE))
        assert len(errors) == 1 and "train.text_encoder_lr is supported for sd15/sdxl" in errors[0], (family, errors)
        assert "train.text_encoder_lr=null" in errors[0]
    errors = validate.config_errors(_cfg("model=tiny_sd15", TE, "text.offload_encoders=true"))
    assert len(errors) == 1 and "text.offload_encoders=true" in errors[0]
    errors = validate.config_errors(_cfg("model=tiny_sd15", TE, "train.network=dora", "export.format=diffusers"))
    assert len(errors) == 1 and "train.network=dora" in errors[0] and "magnitudes" in errors[0]


def test_keys_off_unchanged_on_with_encoders(sd15):
    cfg, plan = sd15["cfg"], sd15["plan"]
    off = updated(cfg, {"train.text_encoder_lr": None})
    latent_keys = {it["name"]: it["name"] for it in plan.items}  # stand-ins: only the keys' inputs matter here
    texts_off = cache_text.item_keys(off, plan)
    assert any(n.startswith("caption:") for n in texts_off)
    # off, the setting is left out of the key: keys stored before it existed still match (train_key._DEFAULTS)
    inputs_off = train_key.inputs(off, plan, latent_keys, texts_off)
    assert "train.text_encoder_lr" not in inputs_off and "text_encoders" not in inputs_off

    on = train_key.inputs(cfg, plan, latent_keys, {})
    assert on["train.text_encoder_lr"] == 0.05 and on["text_encoders"] == plan.ids["text"]
    # nothing is cached for training or sampling: cache_text has no item, and the report says why
    texts = sd15["texts"]
    assert texts["items"] == {} and texts["computed"] == 0 and cache_text.named_texts(plan, cfg) == {}
    entry = node_entry({**texts, "seconds": 0.0}, None)
    assert entry["text_encoding"].startswith("live: train.text_encoder_lr trains the text encoders")
    assert "text_encoding" not in node_entry({**cache_text.run(off, plan, sd15["store"]), "seconds": 0.0}, None)
    # the sample node names each text it encodes (text + encoders) and the live encoding
    inputs = sample.prompt_inputs(cfg, plan, {})[f"prompt:{plan.prompts[0]['line']}"]
    assert inputs["prompt"] == cache_text.text_key(cfg, plan, plan.prompts[0]["prompt"])
    assert inputs["text_encoding"] == "live" and inputs["empty"] == cache_text.text_key(cfg, plan, "")


def test_resume_from_a_checkpoint_is_exact(sd15, tmp_path):
    store, lora = sd15["store"], sd15["lora"]
    # the checkpoint holds the encoders' LoRA weights, their AdamW moments and their optimizer group
    trajectory = train.trajectory_key(lora["inputs"], sd15["cfg"].train)
    saved = store.get_tensors(checkpoints.KIND, checkpoints.checkpoint_key(trajectory, 2))
    te = [k for k in saved if k.startswith("lora/text_encoder.")]
    assert te and all(f"adam/{k[5:]}/exp_avg" in saved for k in te)
    groups = store.meta(checkpoints.KIND, checkpoints.checkpoint_key(trajectory, 2))["optimizer_groups"]
    assert len(groups) == 2

    _run(tmp_path, *RUN, "train.max_steps=2")  # stopped at the step-2 checkpoint
    continued = _run(tmp_path, *RUN)["lora"]
    assert continued["continued_from_step"] == 2
    assert Path(continued["lora"]).read_bytes() == Path(lora["lora"]).read_bytes()


def test_captions_are_encoded_live_with_augmentation_and_the_encoders_train(sd15):
    """Step 1 (the encoders' LoRA starts at zero) gives the live path's loss, caption dropout and shuffle
    included: the same captions, drawn the same way; step 2 differs: the encoders trained."""
    aug = ("data.caption_dropout_rate=0.3", "data.shuffle_caption=true", "train.max_steps=2")
    root = sd15["store"].root
    live = _run(root, "text.cache=false", *aug)["lora"]
    trained = _run(root, TE, *aug)["lora"]
    assert trained["inputs"]["augment"]["mode"] == "live"
    store = sd15["store"]
    a, b = (store.meta(train.KIND, r["key"])["step_losses"] for r in (live, trained))
    assert a[0] == b[0] and a[1] != b[1]


def _encode(pipe, text=PROMPT):
    with torch.no_grad():
        out = pipe.encode_prompt(text, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False)
    return [t for t in out if t is not None]


def _pipe(plan, adapter_cls, lora=None):
    """The family's pipeline from the tiny model's folder, with `lora` (a file, or a dict of its tensors) loaded."""
    pipe = adapter_cls.pipeline_cls.from_pretrained(plan.model_dir, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora if isinstance(lora, dict) else str(lora))
    return pipe


@pytest.mark.numerics
@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_exported_files_change_the_encoders_alike(family, sd15, tmp_path):
    from tasks.models import adapter_class

    run = sd15 if family == "sd15" else _run(tmp_path / "store", TE, "train.alpha=2", "train.rslora=true", family="sdxl")
    cfg, plan, store, lora = run["cfg"], run["plan"], run["store"], run["lora"]
    diffusers_file, kohya = publish.diffusers_file(store, lora), publish.kohya_file(cfg, plan, store, lora)
    components = ("text_encoder",) if family == "sd15" else ("text_encoder", "text_encoder_2")
    keys = load_file(str(diffusers_file)).keys()
    assert {k.split(".")[0] for k in keys} == {"unet", *components}
    assert all(k.split(".", 2)[1] == "text_model" for k in keys if k.startswith("text_encoder"))  # hub layout
    prefixes = {"sd15": {"lora_te"}, "sdxl": {"lora_te1", "lora_te2"}}[family]
    kohya_keys = load_file(str(kohya)).keys()
    assert {k.split("_text_model_")[0] for k in kohya_keys if k.startswith("lora_te")} == prefixes
    assert any(k.startswith("lora_te") and k.endswith("_self_attn_q_proj.lora_down.weight") for k in kohya_keys)
    with safe_open(str(kohya), "pt") as f:
        assert f.metadata()["ss_text_encoder_lr"] == "0.05"

    cls = adapter_class(family)
    base_pipe = _pipe(plan, cls)
    bound = sums(*(getattr(base_pipe, c) for c in components))  # the encoders, each layer a chained sum
    base = _encode(base_pipe)
    by_diffusers, by_kohya = _encode(_pipe(plan, cls, diffusers_file)), _encode(_pipe(plan, cls, kohya))
    trained = _encode(_pipe(plan, cls, lora["lora"]))  # the stored (unbaked) file, as the sample node loads it
    assert len(base) == len(components)  # SD1.5: the embeddings; SDXL: embeddings and pooled
    for b, t, d, k in zip(base, trained, by_diffusers, by_kohya):
        # the trained encoders' LoRA changes the outputs by more than rounding could
        assert (d - b).abs().max() > rounding(**bound, magnitude=b.abs().max().item())
        assert_close(d, t, **bound, what="diffusers file")  # alpha (and rslora) baked in alike
        assert_close(k, d, **bound, what="kohya file")
    if family == "sdxl":  # each encoder's own LoRA: CLIP-G's alone changes the pooled output
        pooled = _encode(_pipe(plan, cls, {k: v for k, v in load_file(str(diffusers_file)).items()
                                           if not k.startswith("text_encoder.")}))[1]
        assert (pooled - base[1]).abs().max() > rounding(**bound, magnitude=base[1].abs().max().item())


def test_samples_are_rendered_with_the_trained_encoders(sd15):
    """The sample node's image is what diffusers renders from the prompt string with the LoRA file loaded, and
    not what it renders with the file's unet layers alone."""
    from tasks.models.sd15 import SD15Adapter

    plan, lora = sd15["plan"], sd15["lora"]
    p = next(p for p in plan.prompts if not p["negative"] and not p["width"])
    s = sample.settings(sd15["cfg"], plan, p)
    got = np.asarray(Image.open(sd15["samples"]["samples"][plan.prompts.index(p)]))

    def render(lora_file):
        pipe = _pipe(plan, SD15Adapter, lora_file)
        return np.asarray(pipe(p["prompt"], width=s["width"], height=s["height"], num_inference_steps=s["steps"],
                               guidance_scale=s["guidance"], generator=torch.Generator("cpu").manual_seed(s["seed"])
                               ).images[0]).astype(int)

    assert np.abs(got.astype(int) - render(lora["lora"])).max() <= 1
    unet_only = {k: v for k, v in load_file(lora["lora"]).items() if k.startswith("unet.")}
    assert np.abs(got.astype(int) - render(unet_only)).max() > 1
    # samples during training encode with the encoders as they are: at the last step, the sample node's image
    assert lora["sample_warnings"] == [] and set(lora["checkpoint_samples"]) == {"2", "4"}
    during = next(e for e in lora["checkpoint_samples"]["4"] if e["line"] == p["line"])
    assert np.abs(np.asarray(Image.open(during["path"])).astype(int) - got).max() <= 1
