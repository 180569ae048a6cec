"""Krea 2 LoRAs (`model=tiny_krea2`, tasks/models/krea2.py and tiny_krea2.py): the tiny Krea2Pipeline is built offline,
deterministically, with Krea 2's geometry (2x2 patches of the /8 Qwen-Image VAE, GQA, a text-fusion stage over a stack
of the text encoder's hidden states) and the pipeline's 34-token system prefix and 5-token assistant suffix.

- Text: what the pipeline's encode_prompt returns, byte for byte (padding in the middle of the template, its mask).
- One training step with a peft LoRA on the default targets: finite loss, non-zero LoRA gradients; the latents are
  packed and unpacked as the pipeline packs them.
- `sample` from cached text is the pipeline's own image from the prompt strings, with and without CFG.
- The saved LoRA loads with Krea2Pipeline.load_lora_weights and gives the trained model's output.
- The whole DAG through the CLI on the demo images.
- The kohya file (= the ComfyUI file) is mapped completely by ComfyUI's generic rule onto its Krea 2 model's names,
  each module's merged delta the PEFT one; diffusers' own Krea 2 LoRA converter names the same modules.
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
from tasks.models.krea2 import Krea2Adapter, pack, unpack
from tasks.models.tiny.tiny_krea2 import build_tiny_krea2

REPO = Path(__file__).resolve().parents[1]
L = 32  # tiny_krea2.yaml's max_sequence_length
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTIONS = ["a red circle on a blue background", "blurry", ""]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_krea2(tmp_path_factory.mktemp("tiny_krea2"))


@pytest.fixture(scope="module")
def adapter(model):
    return Krea2Adapter(model, "float32", L)


@pytest.fixture(scope="module")
def encoders(adapter):
    return adapter.load_text_encoders()


@pytest.fixture(scope="module")
def texts(adapter, encoders):
    return adapter.encode_text(encoders, CAPTIONS)


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _pipe(model):
    from diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained(model, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _lora(adapter, **kw):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets(), **kw))
    return denoiser


def test_build_is_deterministic_and_has_krea2_geometry(model, tmp_path):
    again = build_tiny_krea2(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    pipe = _pipe(model)
    assert (pipe.vae_scale_factor, pipe.patch_size, Krea2Adapter.size_multiple) == (8, 2, 16)
    cfg = pipe.transformer.config
    assert cfg.in_channels == 4 * pipe.vae.config.z_dim and cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.num_text_layers == len(pipe.text_encoder_select_layers) and not pipe.config.is_distilled
    assert type(pipe.text_encoder).__name__ == "Qwen3VLModel"
    assert pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.max_image_seq_len == 6400
    # the pipeline drops the first 34 tokens: with the tiny tokenizer they are exactly the system prefix; the
    # assistant suffix is its 5 tokens
    ids = pipe.tokenizer([pipe.prompt_template_encode_prefix + "a red box"]).input_ids[0]
    assert pipe.tokenizer.convert_ids_to_tokens(ids[31:35]) == ["<|im_start|>", "user", "Ċ", "a"]
    suffix = pipe.tokenizer([pipe.prompt_template_encode_suffix]).input_ids[0]
    assert len(suffix) == pipe.prompt_template_encode_num_suffix_tokens == 5


def test_text_is_what_encode_prompt_returns(encoders, texts):
    for d in texts:  # every caption at the same fixed length: they stack into one batch
        assert list(d) == ["prompt_embeds", "prompt_embeds_mask"]
        assert d["prompt_embeds"].shape == (L, 3, 32) and d["prompt_embeds_mask"].dtype == torch.int64
    with torch.no_grad():
        embeds, mask = encoders.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=L)
        alone, alone_mask = encoders.encode_prompt([CAPTIONS[0]], device="cpu", max_sequence_length=L)
    for i, d in enumerate(texts):  # the same call: the same bytes
        assert torch.equal(d["prompt_embeds"], embeds[i]) and torch.equal(d["prompt_embeds_mask"].bool(), mask[i])
    torch.testing.assert_close(texts[0]["prompt_embeds"], alone[0])  # alone: batched matmul's summation order
    assert torch.equal(texts[0]["prompt_embeds_mask"].bool(), alone_mask[0])
    # padding sits in the middle: [prompt | PAD | 5 suffix tokens]
    m = texts[2]["prompt_embeds_mask"]
    assert m[-5:].all() and not m[-6] and int(m.sum()) == 5  # the empty caption: the suffix alone
    assert int(texts[0]["prompt_embeds_mask"].sum()) > int(texts[1]["prompt_embeds_mask"].sum()) > 5


def test_latents_are_packed_and_normalised_as_the_pipeline_does(adapter, model):
    pipe = _pipe(model)
    z = torch.randn(2, 4, 6, 4, generator=torch.Generator().manual_seed(0))
    packed = pack(z)
    assert torch.equal(packed, pipe._pack_latents(z, 2, 4, 6, 4))
    assert torch.equal(unpack(packed, 6, 4), pipe._unpack_latents(packed, 48, 32)[:, :, 0])
    vae = adapter.load_vae()
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = adapter.encode_latents(vae, pixels)
    assert latents.shape == (1, 4, 4, 6)
    # the pipeline's decode input: latents / (1 / std) + mean, the VAE's own mode
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 4, 1, 1)
    raw = vae.encode(pixels[:, :, None]).latent_dist.mode()[:, :, 0]
    torch.testing.assert_close(latents / std + torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1), raw)


def test_one_training_step(adapter, texts):
    denoiser = _lora(adapter)
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    assert len(modules) == 2 * 8  # per block: q, k, v, gate, out; SwiGLU gate, up, down
    assert all(m.startswith("transformer_blocks.") for m in modules)
    latents = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    text = {k: torch.stack([texts[0][k], texts[1][k]]) for k in texts[0]}
    loss = adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in lora.values() if p.grad is not None]
    assert len(grads) == len(lora)  # lora_B starts at zero: every B gets a gradient, A's follow once B moves
    assert all(p.grad.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)


@pytest.mark.parametrize("guidance,negative", [(0.0, None), (4.5, None), (4.5, 1)])
def test_sample_from_cached_text_is_the_pipelines_image(adapter, texts, model, guidance, negative):
    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    image = adapter.sample(pipe, texts[0], texts[negative] if negative else None, texts[2], 48, 32, 2, guidance, 1.0,
                           seed=0)
    assert image.size == (48, 32)
    # the pipeline from the prompt strings (its own text encoder; its default negative is "")
    ref = _pipe(model)(prompt=CAPTIONS[0], negative_prompt=CAPTIONS[negative] if negative else None, width=48,
                       height=32, num_inference_steps=2, guidance_scale=guidance, max_sequence_length=L,
                       generator=torch.Generator().manual_seed(0)).images[0]
    mine, ref = np.asarray(image).astype(np.int16), np.asarray(ref).astype(np.int16)
    # the cached text was encoded in a batch of three, the pipeline's one caption at a time: float32 sums in another
    # order (test_text_...: equal to assert_close), so at most one rounding step of 8-bit pixels apart
    assert np.abs(mine - ref).max() <= 1


def test_saved_lora_loads_with_load_lora_weights_and_gives_the_trained_output(adapter, texts, model, tmp_path):
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = _lora(adapter, lora_alpha=8, init_lora_weights="gaussian")
    optimizer = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)
    text = {k: v[None] for k, v in texts[0].items()}
    latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))
    pipe = _pipe(model)
    t = pipe.transformer
    inputs = dict(hidden_states=pack(torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(3))),
                  encoder_hidden_states=text["prompt_embeds"], timestep=torch.tensor([0.6]),
                  position_ids=pipe.prepare_position_ids(L, 2, 2, "cpu"),
                  encoder_attention_mask=text["prompt_embeds_mask"].bool(), return_dict=False)
    with torch.no_grad():
        before = t(**inputs)[0]
        pipe.load_lora_weights(str(file))  # what load_sampler does
        assert sum("lora_A" in n for n in t.state_dict()) == 16
        after = t(**inputs)[0]
        trained = denoiser(**inputs)[0]
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, trained)  # the file's alpha / rank scale (2.0) is the trained one


def test_whole_dag_through_the_cli_on_the_demo_images(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> report through `python -m flows.train
    model=tiny_krea2` on the demo images at 32 px."""
    from conftest import cli_env

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "model=tiny_krea2", f"data.dir={REPO / 'data' / 'demo'}",
         "data.resolution=32", "train.max_steps=2", "sample.steps=2", "export.format=both", "train.log_with=none",
         f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=cli_env(tmp_path / "prefect-home"), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["nodes"]) >= {"validate", "cache_latents", "cache_text", "train", "sample"}
    assert report["nodes"]["train"]["status"] == "ran"
    samples = report["artifacts"]["samples"]
    assert samples and all(s.endswith(".png") and Path(s).is_file() for s in samples)
    files = report["artifacts"]["lora_files"]
    assert {"diffusers", "kohya"} <= set(files) and all(Path(f).is_file() for f in files.values())
    assert files.get("comfyui", files["kohya"]) == files["kohya"]  # no fused q/k/v: the kohya file is ComfyUI's


# ComfyUI's Krea 2 model (comfyanonymous/ComfyUI, comfy/ldm/krea2/model.py at 08381b1a9d037ec9aa33f5943bfa0414d78f1e22):
# SingleStreamDiT's Linears, as its __init__s name them: `blocks.N` (SingleStreamBlock: attn.wq/wk/wv/gate/wo,
# class Attention's lines 68-73; mlp.gate/up/down, class SwiGLU's lines 53-55), `txtfusion.layerwise_blocks.N` /
# `txtfusion.refiner_blocks.N` (TextFusionBlock, the same attn and mlp; 2 of each, TextFusionTransformer),
# `txtfusion.projector`, `first`, `tmlp.0` / `tmlp.2`, `txtmlp.1` / `txtmlp.3` (txtmlp.0 is its RMSNorm), `tproj.1`,
# `last.linear`. Its LoRA keys: comfy/lora.py `model_lora_keys_unet` (commit 41444b5236c613ee5ff7d09aa620f94b702f30eb,
# the loop at the function's top) maps `lora_unet_<k, "." -> "_">` for every `diffusion_model.<k>.weight` of any
# model; it registers no Krea 2 specific (`lycoris_`, `transformer.`) names. {ComfyUI module: (out, in)} from the tiny config, by ComfyUI's own
# shape rules (wk/wv: kv heads x head dim; SwiGLU's width is the config's intermediate size)
def comfy_krea2_keys(cfg) -> dict[str, tuple[int, int]]:
    f, hd, t = cfg.num_attention_heads * cfg.attention_head_dim, cfg.attention_head_dim, cfg.text_hidden_dim
    th = t // cfg.text_num_attention_heads

    def block(prefix, width, heads, kv, head, mlp):
        return {f"{prefix}.attn.wq": (heads * head, width), f"{prefix}.attn.wk": (kv * head, width),
                f"{prefix}.attn.wv": (kv * head, width), f"{prefix}.attn.gate": (width, width),
                f"{prefix}.attn.wo": (width, width), f"{prefix}.mlp.gate": (mlp, width),
                f"{prefix}.mlp.up": (mlp, width), f"{prefix}.mlp.down": (width, mlp)}

    keys = {}
    for i in range(cfg.num_layers):
        keys.update(block(f"blocks.{i}", f, cfg.num_attention_heads, cfg.num_key_value_heads, hd,
                          cfg.intermediate_size))
    for kind in ("layerwise_blocks", "refiner_blocks"):
        for i in range(2):
            keys.update(block(f"txtfusion.{kind}.{i}", t, cfg.text_num_attention_heads, cfg.text_num_key_value_heads,
                              th, cfg.text_intermediate_size))
    keys.update({"txtfusion.projector": (1, cfg.num_text_layers), "first": (f, cfg.in_channels),
                 "tmlp.0": (f, cfg.timestep_embed_dim), "tmlp.2": (f, f), "txtmlp.1": (f, t), "txtmlp.3": (f, f),
                 "tproj.1": (6 * f, f), "last.linear": (cfg.in_channels, f)})
    return keys


def test_kohya_file_is_mapped_completely_by_comfyui_with_the_trained_delta(adapter):
    """A LoRA on EVERY Linear of the tiny model (every rule of the kohya layout): the kohya file's every key is one
    ComfyUI's generic rule maps to a weight of its Krea 2 model of the right shape, the merged delta the PEFT one
    (float32 rounding of one product, support.REL). Which diffusers module each ComfyUI module is comes from diffusers'
    own converter (`_convert_non_diffusers_krea2_lora_to_diffusers`, reading ai-toolkit / ComfyUI `diffusion_model.`
    keys), not from loraflow's rules; its single-file converter agrees on every weight's shape."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_krea2_lora_to_diffusers
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    from lora_fixtures import random_lora
    from support import REL, comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya, to_comfyui

    den = adapter.load_denoiser()
    keys = comfy_krea2_keys(den.config)
    linears = {n: m for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == len(keys)  # ComfyUI's model has exactly the Linears diffusers' has
    shapes = {k: v.shape for k, v in den.state_dict().items()}
    original = convert_krea2_transformer_checkpoint_to_diffusers(
        {f"model.diffusion_model.{k}.weight": torch.zeros(s) for k, s in keys.items()})
    assert all(shapes[k] == v.shape for k, v in original.items())
    module_of = {}  # ComfyUI module -> diffusers Linear, one key at a time through diffusers' converter
    for k in keys:
        (d,) = _convert_non_diffusers_krea2_lora_to_diffusers({f"diffusion_model.{k}.lora_A.weight": torch.zeros(1)})
        module_of[k] = d.removeprefix("transformer.").removesuffix(".lora_A.weight")
    assert set(module_of.values()) == set(linears)

    sd, _ = random_lora(den, "|".join(re.escape(n) for n in linears), 4, 8)
    file = to_kohya("krea2", sd, 4, 8)
    assert comfyui_loads_kohya("krea2") and to_comfyui("krea2", sd, 4, 8).keys() == file.keys()
    merged = comfyui_merge("krea2", file, keys)
    assert set(merged) == set(keys)
    for key, module in module_of.items():
        want = 2.0 * (sd[f"{module}.lora_B.weight"].double() @ sd[f"{module}.lora_A.weight"].double())
        assert (merged[key] - want).abs().max() <= REL * want.abs().max(), key


def test_diffusers_reads_no_kohya_file_for_krea2():
    """Why the learning check merges the kohya file (reference_kohya = "merge"): Krea2LoraLoaderMixin converts only
    `diffusion_model.` / `base_model.model.` keys (diffusers 0.42.1, loaders/lora_pipeline.py lora_state_dict)."""
    from diffusers import Krea2Pipeline

    file = {"lora_unet_blocks_0_attn_wq.lora_down.weight": torch.zeros(4, 32),
            "lora_unet_blocks_0_attn_wq.lora_up.weight": torch.zeros(32, 4),
            "lora_unet_blocks_0_attn_wq.alpha": torch.tensor(4.0)}
    assert not any(k.startswith("transformer.") for k in Krea2Pipeline.lora_state_dict(file))
    assert Krea2Adapter.reference_kohya == "merge"


@pytest.mark.parametrize("network", ["loha", "lokr"])
def test_lycoris_run_exports_in_comfyuis_names_and_loads_back(network, tmp_path):
    """train.network=loha|lokr through the nodes: the run's `lycoris` (= `comfyui`) file is in ComfyUI's generic
    `lora_unet_<its module>` names (no `lycoris_` name is mapped for Krea 2), and put back on the model by loraflow's
    loader (the learning check's) every module's delta is the trained one."""
    from safetensors.torch import load_file

    from tasks import cache_latents, cache_text, publish, train, validate
    from tasks.config import compose, resolve_paths
    from tasks.models.lora_variants import lycoris
    from tasks.store import Store
    from tolerance import rounding

    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}", "model=tiny_krea2",
                                          f"data.dir={REPO / 'data' / 'demo'}", "data.resolution=32",
                                          "train.max_steps=2", "train.lr=0.02", "train.log_with=none",
                                          f"train.network={network}"])[0])
    store = Store(tmp_path / "store")
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, latents["items"], texts["items"])
    files = publish.publish(cfg, plan, store, tmp_path / "run", lora, [])["lora_files"]
    assert set(files) == {"lycoris", "comfyui"} and files["lycoris"] == files["comfyui"]
    exported = load_file(files["lycoris"])
    assert exported and all(re.match(r"lora_unet_blocks_\d+_(attn|mlp)_", k) for k in exported)
    trained, back = Krea2Adapter(plan.model_dir).load_denoiser(), Krea2Adapter(plan.model_dir).load_denoiser()
    lycoris.apply_file(trained, lora["lora"])
    lycoris.apply_lycoris(back, files["lycoris"])
    other = dict(back.named_modules())
    layers = {n: m for n, m in trained.named_modules() if hasattr(m, "get_delta_weight")}
    assert len(layers) == 16
    for name, layer in layers.items():
        want, got = layer.get_delta_weight("default").double(), other[name].get_delta_weight("default").double()
        assert want.abs().max() > 0, f"{name} did not train"
        assert (got - want).abs().max().item() <= rounding(16, stages=3, magnitude=want.abs().max().item()), name
