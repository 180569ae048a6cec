"""FLUX.2 [dev] (tasks/models/flux2_dev.py) on the tiny model (tasks/models/tiny/tiny_flux2_dev.py): the cached text
is Flux2Pipeline.encode_prompt's bytes, sampling from the cache is the pipeline from strings, training feeds
the guidance embedding, and the whole DAG runs through the CLI with both LoRA files loading into Flux2Pipeline."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

from tasks.config_schema import ModelConfig, TrainConfig
from tasks.models import adapter_class, resolve_model
from tasks.store import Store
from support import REPO
from support import run_cli
from tolerance import assert_close, render_sums, rounding

SEQ = 64  # conf/model/tiny_flux2_dev.yaml
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry, green"
TEXTS = [PROMPT, "", "a much longer caption about a green square on a white background that runs past the "
         "tokens the window holds after the system message, so that the end of it is cut off here"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    model = ModelConfig(family="flux2_dev", path=None, seed=0, arch={})
    return adapter_class("flux2_dev")(resolve_model(model, Store(tmp_path_factory.mktemp("store"))), "float32", SEQ)


def _strings(adapter):
    pipe = Flux2Pipeline.from_pretrained(adapter.model_dir, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_encode_text_equals_the_pipelines_encode_prompt(adapter):
    encoders = adapter.load_text_encoders()
    ours = [adapter.encode_text(encoders, [t])[0] for t in TEXTS]
    batch = adapter.encode_text(encoders, TEXTS)
    pipe = _strings(adapter)
    assert pipe.text_encoder.config.text_config.num_hidden_layers > 30  # hidden state 30 is a layer's, pre-norm
    chat = pipe.tokenizer.apply_chat_template(
        [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
          {"role": "user", "content": [{"type": "text", "text": "x"}]}]], tokenize=False)[0]
    assert chat == f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]x[/INST]"
    for text, mine, batched in zip(TEXTS, ours, batch):
        with torch.no_grad():
            embeds, _ = pipe.encode_prompt([text], max_sequence_length=SEQ)
        assert mine["prompt_embeds"].shape == (SEQ, 3 * pipe.text_encoder.config.text_config.hidden_size)
        assert torch.equal(mine["prompt_embeds"], embeds[0])
        assert torch.equal(batched["prompt_embeds"], embeds[0])
    assert not torch.equal(ours[0]["prompt_embeds"], ours[1]["prompt_embeds"])  # the caption fits the window


def test_samples_from_cache_as_the_pipeline_from_strings(adapter, caplog):
    """The guidance is the distilled model's input (no CFG): the cached embeddings at guidance 4 and 1 give
    the pipeline's image from strings; a negative prompt is not used (Flux2Pipeline has none), with a warning."""
    prompt, negative, empty = adapter.encode_text(adapter.load_text_encoders(), [PROMPT, NEGATIVE, ""])
    sampler, strings = adapter.load_sampler(None), _strings(adapter)
    images = []
    for guidance in (4.0, 1.0):
        kw = dict(width=64, height=64, steps=2, guidance=guidance, true_cfg=1.0, seed=5)
        mine = adapter.sample(sampler, prompt, None, empty, **kw)
        reference = strings(prompt=PROMPT, guidance_scale=guidance, width=64, height=64, num_inference_steps=2,
                            max_sequence_length=SEQ, generator=torch.Generator("cpu").manual_seed(5)).images[0]
        assert np.abs(np.asarray(mine).astype(int) - np.asarray(reference).astype(int)).max() <= 1, guidance
        images.append(np.asarray(mine))
    assert not np.array_equal(*images)  # the guidance reaches the model
    with caplog.at_level(logging.WARNING, logger="loraflow"):
        with_negative = adapter.sample(sampler, prompt, negative, empty, **kw)
    assert np.array_equal(np.asarray(with_negative), images[1]) and "--n is ignored" in caplog.text


def test_training_feeds_train_guidance_to_the_guidance_embedding(adapter):
    latents = torch.randn(1, 4 * 4, 2, 2, generator=torch.Generator().manual_seed(0))
    text = {"prompt_embeds": adapter.encode_text(adapter.load_text_encoders(), [PROMPT])[0]["prompt_embeds"][None]}
    transformer, scheduler = adapter.load_denoiser(), adapter.load_train_scheduler()
    assert transformer.config.guidance_embeds

    def loss(guidance):
        cfg = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, guidance=guidance)
        with torch.no_grad():
            return adapter.training_loss(transformer, latents, text, cfg, scheduler, [torch.Generator().manual_seed(3)])

    assert torch.equal(loss(1.0), loss(1.0)) and not torch.equal(loss(1.0), loss(3.5))


def test_whole_dag_through_the_cli_and_both_lora_files_load_into_flux2_pipeline(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "demo", data)
    run_dir = tmp_path / "run"
    proc = run_cli(["model=tiny_flux2_dev", f"data.dir={data}", f"store.root={tmp_path / 'store'}",
                 f"hydra.run.dir={run_dir}", "data.resolution=32", "train.max_steps=3", "train.log_every=1",
                 "sample.steps=2"], REPO, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert {n: e["status"] for n, e in report["nodes"].items() if n != "caption"} == dict.fromkeys(
        ("validate", "cache_latents", "cache_text", "train", "sample"), "ran")
    assert report["nodes"]["cache_latents"]["computed"] == 12 and len(report["loss"]) == 3
    assert all(np.isfinite(e["loss"]) for e in report["loss"])
    art = report["artifacts"]
    assert len(art["samples"]) == 3 and all(Path(p).is_file() for p in art["samples"])
    assert set(art["lora_files"]) == {"diffusers", "kohya", "comfyui"} and art["lora_files"]["comfyui"] == art["lora_files"]["kohya"]

    def render(lora):
        pipe = Flux2Pipeline.from_pretrained(art["base_model"], use_safetensors=True)
        pipe.set_progress_bar_config(disable=True)
        if lora:
            pipe.load_lora_weights(lora)
        render.sums = render_sums(pipe, steps=2)
        return pipe(prompt=PROMPT, height=64, width=64, num_inference_steps=2, max_sequence_length=SEQ,
                    generator=torch.Generator("cpu").manual_seed(0), output_type="pt").images

    base, diffusers_file, kohya_file = render(None), render(art["lora_files"]["diffusers"]), render(art["lora_files"]["kohya"])
    # 3 steps of lr 2e-3 move the image by more than rounding could; images in [0, 1]: magnitude 1
    assert (base - diffusers_file).abs().max() > rounding(**render.sums)
    assert_close(kohya_file, diffusers_file, magnitude=1.0, **render.sums, what="BFL names, diffusers' converter")
