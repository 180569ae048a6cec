"""ERNIE-Image LoRAs (`model=tiny_ernie_image`, tasks/models/ernie_image.py and tiny_ernie_image.py): the tiny
ErnieImagePipeline is built offline, deterministically, with ERNIE-Image's geometry (the FLUX.2 VAE /8, 2x2 patches
into 4C channels, /16 in all; a Mistral3Model text encoder read at hidden_states[-2]).

- Latents: patchified and batch-norm normalised as the pipeline un-does them before vae.decode.
- Text: each caption what the pipeline's encode_prompt returns, byte for byte, in a zero-padded window with a mask.
- One training step with a peft LoRA on the default targets: finite loss, non-zero LoRA gradients.
- `sample` from cached text is the pipeline's own image from the prompt strings, with and without CFG.
- The saved LoRA loads with ErnieImagePipeline.load_lora_weights and gives the trained model's output.
- The whole DAG through the CLI on the demo images. The kohya file is the ComfyUI file: musubi-tuner's names, every
  key mapped by ComfyUI's generic rule to a Linear of its Ernie model, merging to the PEFT delta.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.config_schema import TrainConfig
from tasks.models.ernie_image import ErnieImageAdapter, _TextEncoders
from tasks.models.tiny.tiny_ernie_image import build_tiny_ernie_image

REPO = Path(__file__).resolve().parents[1]
L = 32  # tiny_ernie_image.yaml's max_sequence_length
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTIONS = ["a red circle on a blue background", "a green square, blurry", ""]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_ernie_image(tmp_path_factory.mktemp("tiny_ernie"))


@pytest.fixture(scope="module")
def adapter(model):
    return ErnieImageAdapter(model, "float32", L)


@pytest.fixture(scope="module")
def texts(adapter, model):
    # encoded by the pipeline's own text encoder: the same modules give the same bytes (test_text_...)
    pipe = _pipe(model)
    return adapter.encode_text(_TextEncoders(pipe.tokenizer, pipe.text_encoder), CAPTIONS)


def _pipe(model):
    from diffusers import ErnieImagePipeline

    pipe = ErnieImagePipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _batch(texts, *idx):
    return {k: torch.stack([texts[i][k] for i in idx]) for k in texts[0]}


def _lora(adapter, **kw):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets(), **kw))
    return denoiser


def test_build_is_deterministic_and_has_ernie_image_geometry(model, tmp_path):
    again = build_tiny_ernie_image(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = _pipe(model)
    assert pipe.vae_scale_factor == ErnieImageAdapter.size_multiple == 16
    t = pipe.transformer
    assert t.config.in_channels == 4 * pipe.vae.config.latent_channels == t.config.out_channels
    assert sum(t.config.rope_axes_dim) == t.config.hidden_size // t.config.num_attention_heads
    assert t.config.text_in_dim == pipe.text_encoder.config.text_config.hidden_size
    assert type(pipe.text_encoder).__name__ == "Mistral3Model" and pipe.pe is None
    # the class zero-initialises these (no LoRA gradient would flow): the tiny model does not
    assert t.adaLN_modulation[-1].weight.abs().sum() > 0 and t.final_linear.weight.abs().sum() > 0
    ids = pipe.tokenizer("a red box", add_special_tokens=True)["input_ids"]
    assert ids[0] == pipe.tokenizer.bos_token_id == 1 and len(ids) > 2  # <s>, as Mistral's tokenizer adds it


def test_latents_are_what_the_pipeline_decodes(adapter, model):
    vae = adapter.load_vae()
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = adapter.encode_latents(vae, pixels)
    assert z.shape == (1, 16, 2, 3)
    # the pipeline's decode path: * sqrt(var + 1e-5) + mean, unpatchify -> the VAE's own mode
    pipe = _pipe(model)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)
    raw = pipe._unpatchify_latents(z * std + vae.bn.running_mean.view(1, -1, 1, 1))
    torch.testing.assert_close(raw, vae.encode(pixels).latent_dist.mode())


def test_text_is_what_encode_prompt_returns(adapter, texts, model):
    pipe = _pipe(model)
    ref = pipe.encode_prompt(CAPTIONS, device="cpu")  # one caption at a time, its own length
    for d, r in zip(texts, ref):
        n = int(d["attention_mask"].sum())
        assert d["prompt_embeds"].shape == (L, 16) and d["attention_mask"].shape == (L,)
        assert n == r.shape[0] and d["attention_mask"][:n].all()
        assert torch.equal(d["prompt_embeds"][:n], r)  # the same bytes
        assert not d["prompt_embeds"][n:].any()  # zeros past the caption
    assert int(texts[2]["attention_mask"].sum()) == 1  # "" -> <s> alone, in the pipeline too
    # the adapter's own encoder (streamed in, tasks/models/loading/text_load.py): the same weights at other
    # addresses. A caption of one token (M = 1) runs the CPU's matrix-vector kernel, whose vector loads follow the
    # weights' alignment (from_pretrained's are mmap'ed at 8-byte offsets): one float32 rounding apart there, the
    # same bytes for longer captions
    own = adapter.encode_text(adapter.load_text_encoders(), CAPTIONS + ["red " * 60])
    for d, r in zip(own, texts):
        assert torch.equal(d["attention_mask"], r["attention_mask"])
        torch.testing.assert_close(d["prompt_embeds"], r["prompt_embeds"], rtol=0, atol=1e-7)
    assert all(torch.equal(own[i]["prompt_embeds"], texts[i]["prompt_embeds"]) for i in (0, 1))
    assert own[3]["attention_mask"].all()  # cut at the window (musubi-tuner's rule; the pipeline sets no limit)


def test_one_training_step(adapter, texts):
    denoiser = _lora(adapter)
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    assert len(modules) == 7 * 2  # per block: q, k, v, out, gate, up, down
    latents = torch.randn(2, 16, 2, 2, generator=torch.Generator().manual_seed(1))
    loss = adapter.training_loss(denoiser, latents, _batch(texts, 0, 2), TRAIN, adapter.load_train_scheduler(),
                                 _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    # lora_B starts at zero, so lora_A's first gradient is zero: every lora_B's is not (each module is reached)
    grads = {n: p.grad for n, p in lora.items() if "lora_B" in n and p.grad is not None}
    assert len(grads) == len(modules) and all(g.abs().sum() > 0 for g in grads.values())


def test_training_sees_the_captions_as_the_pipeline_pads_them(adapter, texts, model):
    # a batch of two captions of different lengths: the window cut to the longer, the shorter padded with zeros
    # and masked, as the pipeline's _pad_text gives the transformer its CFG batch
    pipe = _pipe(model)
    batch = _batch(texts, 0, 2)
    text_bth, lens = adapter.text_inputs(batch["prompt_embeds"], batch["attention_mask"])
    ref_bth, ref_lens = pipe._pad_text([texts[i]["prompt_embeds"][:int(texts[i]["attention_mask"].sum())]
                                        for i in (0, 2)], "cpu", torch.float32, 16)
    assert torch.equal(text_bth, ref_bth) and torch.equal(lens, ref_lens)


@pytest.mark.parametrize("guidance, negative", [(1.0, None), (4.0, None), (4.0, 1)])
def test_sample_from_cached_text_is_the_pipelines_image(adapter, texts, model, guidance, negative):
    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    neg = texts[negative] if negative is not None else None
    image = adapter.sample(pipe, texts[0], neg, texts[2], 48, 32, 2, guidance, 1.0, seed=0)
    assert image.size == (48, 32)
    ref = _pipe(model)(prompt=CAPTIONS[0], negative_prompt=CAPTIONS[negative] if negative is not None else "",
                       width=48, height=32, num_inference_steps=2, guidance_scale=guidance,
                       generator=torch.Generator().manual_seed(0)).images[0]
    assert np.array_equal(np.asarray(image), np.asarray(ref))  # the same text bytes: the same image


def test_saved_lora_loads_with_load_lora_weights_and_gives_the_trained_output(adapter, texts, model, tmp_path):
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = _lora(adapter, lora_alpha=8, init_lora_weights="gaussian")
    optimizer = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)
    text = _batch(texts, 1)
    latents = torch.randn(1, 16, 2, 2, generator=torch.Generator().manual_seed(2))
    adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))

    pipe = _pipe(model)
    text_bth, lens = adapter.text_inputs(text["prompt_embeds"], text["attention_mask"])
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 3, generator=torch.Generator().manual_seed(3)),
                  timestep=torch.tensor([500.0]), text_bth=text_bth, text_lens=lens, return_dict=False)
    with torch.no_grad():
        before = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(str(file))  # ErnieImageLoraLoaderMixin, what load_sampler calls
        assert sum("lora_A" in n for n in pipe.transformer.state_dict()) == 14
        after = pipe.transformer(**inputs)[0]
        trained = denoiser(**inputs)[0]
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, trained)  # the file's alpha / rank scale (2.0) is the trained one


def test_whole_dag_through_the_cli_on_the_demo_images(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> report through `python -m flows.train
    model=tiny_ernie_image` on the demo images at 32 px."""
    from conftest import cli_env

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na green square --n blurry\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "model=tiny_ernie_image", "train.max_steps=2", "sample.steps=2",
         "data.resolution=32", f"sample.prompts_file={prompts}", "train.log_with=none",
         f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=cli_env(tmp_path / "prefect-home"), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["nodes"]["train"]["status"] == "ran"
    samples = report["artifacts"]["samples"]
    assert len(samples) == 2 and all(s.endswith(".png") and Path(s).is_file() for s in samples)
    files = report["artifacts"]["lora_files"]
    assert set(files) == {"diffusers", "kohya", "comfyui"} and files["comfyui"] == files["kohya"]  # one file
    assert all(Path(f).is_file() for f in files.values())


# The kohya / ComfyUI names, from the sources (read in this workplace's code index):
# - ComfyUI's Ernie model, comfy/ldm/ernie/model.py (comfyanonymous/ComfyUI at 27e7ad36d25b790cf52220c1a462690be900962f):
#   ErnieImageModel.layers (ErnieImageSharedAdaLNBlock: self_attention.to_q / to_k / to_v / to_out.0, lines ~98-106;
#   mlp.gate_proj / up_proj / linear_fc2, lines ~135-140), x_embedder.proj, text_proj, time_embedding.linear_1/2,
#   adaLN_modulation.1, final_norm.linear, final_linear: diffusers' ErnieImageTransformer2DModel names one for one.
#   comfy/supported_models.py (c4d1a8d3567a1363db63e8212b99a1a6bffb5719) class ErnieImage: unet_config
#   image_model "ernie", huggingface_repo baidu/ERNIE-Image, latent_format Flux2.
# - comfy/lora.py model_lora_keys_unet (41444b5236c613ee5ff7d09aa620f94b702f30eb, and the current one as quoted in
#   index file 51926688842): every `diffusion_model.<k>.weight` -> `lora_unet_<k, "." -> "_">` (and bare `<k>`);
#   no ErnieImage branch, so no `lycoris_` or `transformer.` names for it. load_lora: up/down/alpha per module.
# - musubi-tuner (kohya-ss/musubi-tuner at 07f78ab1dacbcda4b42511772c6dc4e593907098):
#   src/musubi_tuner/networks/lora_ernie_image.py: create_network over ErnieImageSharedAdaLNBlock, prefix
#   "lora_unet", exclude `.*(adaLN_modulation|norm).*`; networks/lora.py names each Linear child
#   `lora_unet.<path from the model>` with "." -> "_"; ernie_image/ernie_image_model.py: `layers`, the same names.
MUSUBI_LINEARS = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")


def _comfy_keys(den) -> dict[str, tuple[int, int]]:
    """ComfyUI's Ernie model's Linear weights (without `diffusion_model.`): diffusers' names (model.py above)."""
    return {n: (m.out_features, m.in_features) for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}


def test_kohya_file_is_the_comfyui_file_and_in_musubi_tuners_names(adapter):
    """Every key of the kohya file is read by ComfyUI's generic rule onto a Linear of the right shape and merges to
    the PEFT LoRA's delta; its modules are exactly those musubi-tuner's networks.lora_ernie_image creates."""
    from lora_fixtures import random_lora
    from support import REL, comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya, to_comfyui

    den = adapter.load_denoiser()
    keys = _comfy_keys(den)
    sd, _ = random_lora(den, adapter.default_lora_targets(), 4, 8)
    file = to_kohya("ernie_image", sd, 4, 8)
    assert comfyui_loads_kohya("ernie_image") and to_comfyui("ernie_image", sd, 4, 8).keys() == file.keys()
    merged = comfyui_merge("ernie_image", file, keys)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert set(merged) == modules
    for m in modules:
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[m] - want).abs().max() <= REL * want.abs().max(), m
    musubi = {f"lora_unet.layers.{i}.{m}".replace(".", "_") for i in range(den.config.num_layers)
              for m in MUSUBI_LINEARS}
    assert {k.split(".")[0] for k in file} == musubi
    assert all(file[f"{n}.alpha"].item() == 8.0 for n in musubi)
    # musubi-tuner's exclude pattern leaves no block Linear out: the default targets are all of them
    block = [n for n in keys if n.startswith("layers.0.")]
    assert sorted(block) == sorted(f"layers.0.{m}" for m in MUSUBI_LINEARS)
    assert not any(re.fullmatch(r".*(adaLN_modulation|norm).*", n) for n in block)
