"""HiDream-I1 LoRAs (`model=tiny_hidream`, tasks/models/hidream.py and tiny_hidream.py): the tiny HiDreamImagePipeline
is built offline, deterministically, with HiDream's geometry (MoE feed-forwards, four text encoders, per-block Llama
layers, FLUX.1's /8 VAE, 2x2 patches made by the transformer).

- Text: what HiDreamImagePipeline.encode_prompt returns, byte for byte (pooled CLIP-L | CLIP-G, T5, Llama's stack).
- One training step with a peft LoRA on the default targets (the routed and shared experts included): finite loss,
  non-zero LoRA gradients, the experts' too.
- `sample` from cached text is the pipeline's own image from the prompt strings, with and without CFG / a negative.
- The saved LoRA loads with HiDreamImagePipeline.load_lora_weights and gives the trained model's output.
- The whole DAG through the CLI. The kohya file is the ComfyUI file: every key maps to a weight of ComfyUI's HiDream
  model and merges to the PEFT delta.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.config_schema import TrainConfig
from tasks.models.hidream import HiDreamAdapter
from tasks.models.tiny.tiny_hidream import build_tiny_hidream

REPO = Path(__file__).resolve().parents[1]
L = 32  # every encoder's window (tiny_hidream.yaml's max_sequence_length)
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTIONS = ["a red box on a blue background", "blurry, flat colors", ""]
KEYS = ["pooled_prompt_embeds", "prompt_embeds_t5", "prompt_embeds_llama3"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_hidream(tmp_path_factory.mktemp("tiny_hidream"))


@pytest.fixture(scope="module")
def adapter(model):
    return HiDreamAdapter(model, "float32", L)


@pytest.fixture(scope="module")
def texts(adapter):
    return adapter.encode_text(adapter.load_text_encoders(), CAPTIONS)


@pytest.fixture(scope="module")
def singles(adapter):
    """Each caption encoded alone, as the pipeline encodes one prompt (CLIP's pooled vector moves by ~5e-7 with
    the batch it is run in on the CPU)."""
    enc = adapter.load_text_encoders()
    return [adapter.encode_text(enc, [c])[0] for c in CAPTIONS]


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _pipe(model):
    from diffusers import HiDreamImagePipeline

    pipe = HiDreamImagePipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _lora(adapter, **kw):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets(), **kw))
    return denoiser


def _batch(texts, *i):
    return {k: torch.stack([texts[j][k] for j in i]) for k in KEYS}


def test_build_is_deterministic_and_has_hidreams_geometry(model, tmp_path):
    again = build_tiny_hidream(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = _pipe(model)
    t, c = pipe.transformer, pipe.transformer.config
    assert type(t).__name__ == "HiDreamImageTransformer2DModel"
    assert [type(pipe.components[f"text_encoder{s}"]).__name__ for s in ("", "_2", "_3", "_4")] == [
        "CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "T5EncoderModel", "LlamaForCausalLM"]
    assert pipe.vae_scale_factor == 8 and HiDreamAdapter.size_multiple == 16 and c.patch_size == 2
    assert c.in_channels == pipe.vae.config.latent_channels  # unpacked latents: the transformer patchifies
    assert c.text_emb_dim == pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim
    assert c.caption_channels == [pipe.text_encoder_3.config.d_model, pipe.text_encoder_4.config.hidden_size]
    assert len(c.llama_layers) == c.num_layers + c.num_single_layers  # one Llama layer per block
    assert max(c.llama_layers) == pipe.text_encoder_4.config.num_hidden_layers - 1
    ff = t.double_stream_blocks[0].block.ff_i  # the MoE: gate, routed experts, shared expert
    assert len(ff.experts) == c.num_routed_experts == 4 and ff.gate.top_k == 2 and hasattr(ff, "shared_experts")
    assert sum(a == b for a, b in zip(c.axes_dims_rope, [8, 4, 4])) == 3 and sum(c.axes_dims_rope) == c.attention_head_dim
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (0.3611, 0.1159)  # FLUX.1's VAE
    ids = pipe.tokenizer_4("a red box").input_ids
    assert ids[0] == pipe.tokenizer_4.convert_tokens_to_ids("<|begin_of_text|>")  # Llama 3's bos
    assert pipe.tokenizer_4.pad_token == pipe.tokenizer_4.eos_token == "<|eot_id|>"


def test_latents_are_what_the_pipeline_decodes(adapter):
    vae = adapter.load_vae()
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = adapter.encode_latents(vae, pixels)
    assert z.shape == (1, 4, 4, 6)
    raw = vae.encode(pixels).latent_dist.mode()  # the pipeline's latents / scaling_factor + shift_factor
    torch.testing.assert_close(z / vae.config.scaling_factor + vae.config.shift_factor, raw)


def test_text_is_encode_prompts_bytes(model, texts):
    pipe = _pipe(model)
    with torch.no_grad():
        t5, _, llama, _, pooled, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device="cpu",
                                                         max_sequence_length=L)
    assert llama.shape == (2, 3, L, 32)  # [Llama layers, B, L, D]
    for i, d in enumerate(texts):
        assert list(d) == KEYS
        assert torch.equal(d["pooled_prompt_embeds"], pooled[i]) and d["pooled_prompt_embeds"].shape == (32 + 48,)
        assert torch.equal(d["prompt_embeds_t5"], t5[i]) and d["prompt_embeds_t5"].shape == (L, 32)
        assert torch.equal(d["prompt_embeds_llama3"], llama[:, i])
    assert not torch.equal(texts[0]["prompt_embeds_llama3"], texts[2]["prompt_embeds_llama3"])


def test_one_training_step(adapter, texts):
    denoiser = _lora(adapter)
    denoiser.train()  # the train node's mode: the transformer's training unpatchify and differentiable MoE branch
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    # double block: adaLN, 8 attention Linears, ff_i (3 shared + 4 x 3 routed), ff_t 3; single: adaLN, 4, 15
    assert len(modules) == (1 + 8 + 15 + 3) + (1 + 4 + 15)
    assert not any("caption_projection" in m or "final_layer" in m or "embedder" in m for m in modules)
    latents = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    loss = adapter.training_loss(denoiser, latents, _batch(texts, 0, 1), TRAIN, adapter.load_train_scheduler(), _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = {n: p.grad for n, p in lora.items() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and any(".experts." in n for n in grads)  # the routed experts learn (moe_infer would not)


def test_train_mode_loss_is_the_eval_mode_loss(adapter, texts):
    """The training unpatchify is folded back to the latent layout: the same loss as eval mode's [B, C, h, w]."""
    denoiser = adapter.load_denoiser()
    latents = torch.randn(1, 4, 4, 6, generator=torch.Generator().manual_seed(4))  # non-square: padded patches
    losses = []
    for mode in (True, False):
        denoiser.train(mode)
        with torch.no_grad():
            losses.append(adapter.training_loss(denoiser, latents, _batch(texts, 0), TRAIN,
                                                adapter.load_train_scheduler(), _gens(1)))
    torch.testing.assert_close(losses[0], losses[1])


@pytest.mark.parametrize("guidance,negative", [(5.0, None), (5.0, 1), (1.0, None)])
def test_sample_from_cached_text_is_the_pipelines_image(adapter, singles, model, guidance, negative):
    """CFG (guidance > 1) against the empty prompt or the prompt's negative, and without CFG."""
    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None and pipe.text_encoder_4 is None and pipe.tokenizer_4 is None
    texts = singles
    image = adapter.sample(pipe, texts[0], texts[negative] if negative else None, texts[2], 64, 48, 2, guidance,
                           1.0, seed=0)
    assert image.size == (64, 48)
    ref_pipe = _pipe(model)
    HiDreamAdapter.render_area(ref_pipe, 64, 48)  # the pipeline's 1 MP rescale set to the asked area, as sample does
    ref = ref_pipe(prompt=CAPTIONS[0], negative_prompt=CAPTIONS[negative] if negative else None, width=64, height=48,
                   num_inference_steps=2, guidance_scale=guidance, max_sequence_length=L,
                   generator=torch.Generator().manual_seed(0)).images[0]
    assert np.array_equal(np.asarray(image), np.asarray(ref))


def test_saved_lora_loads_with_load_lora_weights_and_gives_the_trained_output(adapter, texts, model, tmp_path):
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = _lora(adapter, lora_alpha=8, init_lora_weights="gaussian")
    optimizer = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)
    text = _batch(texts, 0)
    latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    denoiser.train()
    adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    denoiser.eval()
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))

    pipe = _pipe(model)
    t = pipe.transformer
    inputs = dict(hidden_states=torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(3)),
                  timesteps=torch.tensor([500.0]), return_dict=False, **adapter.pipeline_text(text, torch.float32))
    with torch.no_grad():
        before = t(**inputs)[0]
        pipe.load_lora_weights(str(file))  # HiDreamImageLoraLoaderMixin, the pipeline's own loader
        assert sum("lora_A" in n for n in t.state_dict()) == 47
        after = t(**inputs)[0]
        trained = denoiser(**inputs)[0]
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, trained)  # the file's alpha / rank scale (2.0) is the trained one


def test_whole_dag_through_the_cli_on_the_demo_images(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> report through `python -m flows.train
    model=tiny_hidream` on the demo images at 32 px."""
    from conftest import cli_env

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "model=tiny_hidream", "train.max_steps=2", "sample.steps=2",
         "data.resolution=32", "train.log_with=none", f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=cli_env(tmp_path / "prefect-home"), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert all(report["nodes"][n]["status"] == "ran" for n in ("cache_latents", "cache_text", "train", "sample"))
    samples = report["artifacts"]["samples"]
    assert samples and all(s.endswith(".png") and Path(s).is_file() for s in samples)
    files = report["artifacts"]["lora_files"]
    assert {"diffusers", "kohya"} <= set(files) and all(Path(f).is_file() for f in files.values())
    assert files.get("comfyui", files["kohya"]) == files["kohya"]  # the kohya file is the ComfyUI file


# ComfyUI's HiDream model (comfyanonymous/ComfyUI; read here, it cannot be installed on these machines):
# - comfy/ldm/hidream/model.py (commit a0f6703f051416ba8d10cc90a4f10b8124fcbb38): HiDreamImageTransformer2DModel has
#   double_stream_blocks / single_stream_blocks of HiDreamImageBlock, each `self.block` (HiDreamImageTransformerBlock /
#   HiDreamImageSingleTransformerBlock) with adaLN_modulation.1, attn1.to_q / to_k / to_v / to_out (+ _t in the
#   double blocks), ff_i (MOEFeedForwardSwiGLU: shared_experts.w1-3, experts.N.w1-3, gate.weight a Parameter) and
#   ff_t.w1-3: diffusers' module names and shapes, Linear for Linear (only final_layer differs: FLUX's LastLayer);
# - comfy/lora.py model_lora_keys_unet (commit 41444b5236c613ee5ff7d09aa620f94b702f30eb, tests/test_comfyui_keys.py):
#   for every `diffusion_model.<k>.weight`, `lora_unet_<k, "." -> "_">` maps to it (the generic rule), and its
#   `isinstance(model, comfy.model_base.HiDream)` branch (in the version find_string returned, after HunyuanVideo's)
#   adds `lycoris_<k, "." -> "_">` ("SimpleTuner lycoris format") and `transformer.<k>` ("SimpleTuner regular format").
def test_kohya_file_is_the_comfyui_file_and_comfyui_merges_it_to_the_peft_delta(adapter):
    from lora_fixtures import random_lora
    from support import REL, comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya

    den = adapter.load_denoiser()
    keys = {n: tuple(m.weight.shape) for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}
    sd, _ = random_lora(den, adapter.default_lora_targets(), 4, 8)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert len(modules) == 47 and modules <= set(keys)  # every trained Linear is one of ComfyUI's
    assert comfyui_loads_kohya("hidream")  # no ComfyUI file apart
    file = to_kohya("hidream", sd, 4, 8)
    merged = comfyui_merge("hidream", file, keys)  # fails on a key ComfyUI leaves unread or a wrong shape
    assert set(merged) == modules
    for m in modules:
        want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
        assert (merged[m] - want).abs().max() <= REL * want.abs().max(), m
