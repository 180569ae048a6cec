"""Qwen-Image 2.1 LoRAs (`model=tiny_qwenimage21`, tasks/models/qwenimage21.py and tiny_qwenimage21.py): the tiny
QwenImage21Pipeline is built offline, deterministically, with Qwen-Image 2.1's geometry (a /16 RGBA VAE, unpatched
latents, one text-encoder slot per 2x2 of them, Qwen3-VL as text encoder, the system turn dropped).

- Latents: /16, normalised by latents_mean/std as the pipeline un-normalises them before decoding.
- Text: what the pipeline's encode_prompt returns, byte for byte, padded to model.max_sequence_length.
- One training step with a peft LoRA on the default targets: finite loss, non-zero LoRA gradients.
- `sample` from cached text is the pipeline's own image from the prompt strings (without and with true CFG).
- The saved LoRA loads with QwenImage21Pipeline.load_lora_weights and gives the trained model's output.
- The whole DAG through the CLI on the demo images. The kohya file is in musubi-tuner's names; the ComfyUI file,
  apart, fuses the MLP's gate_layer and proj as ComfyUI's model does, and merges to the PEFT deltas.
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
from tasks.models.qwenimage21 import QwenImage21Adapter, text_processor
from tasks.models.tiny.tiny_qwenimage21 import SYSTEM, build_tiny_qwenimage21

REPO = Path(__file__).resolve().parents[1]
L = 64  # tiny_qwenimage21.yaml's max_sequence_length
TRAIN = TrainConfig(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, loss="l2")
CAPTIONS = ["a red circle on a blue background", "two green squares", ""]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_qwenimage21(tmp_path_factory.mktemp("tiny_qi21"))


@pytest.fixture(scope="module")
def adapter(model):
    return QwenImage21Adapter(model, "float32", L)


@pytest.fixture(scope="module")
def encoders(adapter):
    return adapter.load_text_encoders()


@pytest.fixture(scope="module")
def texts(adapter, encoders):
    return adapter.encode_text(encoders, CAPTIONS)


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _pipe(model):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(model, processor=text_processor(model), use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _lora(adapter, **kw):
    from peft import LoraConfig

    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=4, target_modules=adapter.default_lora_targets(), **kw))
    return denoiser


def test_build_is_deterministic_and_has_qwenimage21_geometry(model, tmp_path):
    again = build_tiny_qwenimage21(tmp_path / "again")
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (again / f).read_bytes() for f in files)  # same seed, same bytes
    index = json.loads((model / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline" and index["processor"] == ["transformers", "Qwen3VLProcessor"]
    pipe = _pipe(model)
    assert pipe.vae_scale_factor == 16 and QwenImage21Adapter.size_multiple == 32  # /16, 2x2 latents a slot
    assert pipe.transformer.config.in_channels == pipe.vae.config.z_dim == pipe.transformer.config.out_channels
    assert pipe.transformer.config.patch_size == 1 and pipe.vae.config.in_channels == 4  # unpatched; RGBA
    assert pipe.transformer.config.context_in_dim == pipe.text_encoder.config.text_config.hidden_size
    assert type(pipe.text_encoder).__name__ == "Qwen3VLForConditionalGeneration"
    # the dropped prefix is exactly the system turn: the kept tokens start with the user turn
    ids = pipe.processor(text=[pipe.prompt_template_t2i.format("a red box")])["input_ids"][0].tolist()
    tokens = pipe.processor.tokenizer.convert_ids_to_tokens(ids)
    assert tokens[:3] == ["<|im_start|>", "system", "Ċ"] and SYSTEM.split()[0] in "".join(tokens[:pipe._drop_idx])
    assert tokens[pipe._drop_idx - 2:pipe._drop_idx + 2] == ["<|im_end|>", "Ċ", "<|im_start|>", "user"]


def test_latents_are_normalised_as_the_pipeline_undoes_them(adapter):
    vae = adapter.load_vae()
    pixels = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = adapter.encode_latents(vae, pixels)
    assert z.shape == (1, vae.config.z_dim, 4, 6)
    shape = (1, vae.config.z_dim, 1, 1)
    raw = vae.encode(torch.cat([pixels, torch.ones_like(pixels[:, :1])], 1)[:, :, None]).latent_dist.mode()[:, :, 0]
    # `latents * latents_std + latents_mean` before vae.decode (QwenImage21Pipeline.__call__) gives the mode back
    torch.testing.assert_close(z * torch.tensor(vae.config.latents_std).view(shape)
                               + torch.tensor(vae.config.latents_mean).view(shape), raw)


def test_text_is_what_encode_prompt_returns(model, encoders, texts):
    pipe = _pipe(model)  # from the folder, as a user loads it
    for caption, d in zip(CAPTIONS, texts):
        assert list(d) == ["prompt_embeds", "attention_mask"] and d["prompt_embeds"].shape == (L, 32)
        with torch.no_grad():
            embeds, mask, image_pad = pipe.encode_prompt(caption, device="cpu")
        n = embeds.shape[1]
        assert mask is None and not image_pad.any()  # one caption: nothing padded, no image tokens
        assert int(d["attention_mask"].sum()) == n and d["attention_mask"][:n].all()
        assert torch.equal(d["prompt_embeds"][:n], embeds[0]) and not d["prompt_embeds"][n:].any()
    assert int(texts[2]["attention_mask"].sum()) > 0  # "" is encoded as " " (the pipeline's rule)
    from tasks.config import ConfigError

    short = QwenImage21Adapter(model, "float32", 8)
    with pytest.raises(ConfigError, match="cuts nothing"):
        short.encode_text(encoders, [CAPTIONS[0]])


def test_one_training_step(adapter, texts):
    denoiser = _lora(adapter)
    lora = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    modules = {n.split(".lora_")[0] for n in lora}
    assert len(modules) == 2 * 7  # per block: to_q/k/v, to_out.0, img_mlp.proj/gate_layer/out
    assert all(m.startswith("transformer_blocks.") for m in modules)
    latents = torch.randn(2, 8, 2, 4, generator=torch.Generator().manual_seed(1))
    text = {k: torch.stack([texts[0][k], texts[1][k]]) for k in texts[0]}  # captions of different lengths
    loss = adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(2))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in lora.values() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_training_predicts_what_the_pipeline_asks_the_transformer(adapter, texts):
    """Each item as the pipeline runs one prompt: its own caption length, no mask, the target's slots appended."""
    transformer = adapter.load_denoiser()
    noisy = torch.randn(2, 8, 2, 2, generator=torch.Generator().manual_seed(4))
    t = torch.tensor([700.0, 120.0])
    text = {k: torch.stack([texts[0][k], texts[2][k]]) for k in texts[0]}
    with torch.no_grad():
        pred = adapter.predict(transformer, noisy, t, text["prompt_embeds"], text["attention_mask"])
        for i, d in enumerate((texts[0], texts[2])):
            n = int(d["attention_mask"].sum())
            ref = transformer(hidden_states=noisy[i:i + 1].flatten(2).transpose(1, 2), timestep=t[i:i + 1] / 1000,
                              encoder_hidden_states=d["prompt_embeds"][None, :n], img_shapes=[[(1, 2, 2)]],
                              img_mask=torch.tensor([[False] * n + [True]]), return_dict=False)[0]
            assert torch.equal(pred[i], ref[0, -4:].transpose(0, 1).reshape(8, 2, 2))  # __call__: noise_pred[:, -4:]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_known_layout_forward_is_the_transformers_forward(adapter, texts, checkpointed):
    """bench.memory's path (its fake tensors cannot give the mask's values): the same bytes as the forward, the
    LoRA's gradients too, for a caption and the empty one (the same ops in the same order: exact)."""
    from tasks.models.qwenimage21 import known_layout_forward

    for d in (texts[0], texts[2]):
        n = int(d["attention_mask"].sum())
        outs = []
        for known in (False, True):
            torch.manual_seed(0)  # the LoRA's A matrices
            transformer = _lora(adapter)
            if checkpointed:
                transformer.enable_gradient_checkpointing()
            noisy = torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(5))  # 2 x 4 tokens, 8 channels
            embeds, t = d["prompt_embeds"][None, :n], torch.tensor([0.3])
            out = (known_layout_forward(transformer, noisy, embeds, t, 2, 4) if known else
                   transformer(hidden_states=noisy, timestep=t, encoder_hidden_states=embeds, img_shapes=[[(1, 2, 4)]],
                               img_mask=torch.tensor([[False] * n + [True] * 2]), return_dict=False)[0])
            out.square().sum().backward()
            outs.append((out, [p.grad for p in transformer.parameters() if p.requires_grad]))
        assert torch.equal(outs[0][0], outs[1][0])
        assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


@pytest.mark.parametrize("true_cfg", [1.0, 3.0])
def test_sample_from_cached_text_is_the_pipelines_image(adapter, texts, model, true_cfg):
    pipe = adapter.load_sampler(None)
    assert pipe.text_encoder is None
    negative = adapter.encode_text(adapter.load_text_encoders(), ["blurry"])[0]
    image = adapter.sample(pipe, texts[0], negative, texts[2], 64, 32, 2, 1.0, true_cfg, seed=0)
    assert image.size == (64, 32) and image.mode == "RGB"
    ref = _pipe(model)(prompt=CAPTIONS[0], negative_prompt="blurry", true_cfg_scale=true_cfg, width=64, height=32,
                       num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    assert ref.shape == (32, 64, 4)  # the VAE decodes RGBA: the sample keeps the colour channels
    assert np.array_equal(np.asarray(image), (ref[..., :3] * 255).round().astype(np.uint8))


def test_saved_lora_loads_with_load_lora_weights_and_gives_the_trained_output(adapter, texts, model, tmp_path):
    from peft.utils import get_peft_model_state_dict

    from tasks.models.lora_variants.text_encoder_lora import peft_config

    denoiser = _lora(adapter, lora_alpha=8, init_lora_weights="gaussian")
    optimizer = torch.optim.AdamW([p for p in denoiser.parameters() if p.requires_grad], lr=1e-2)
    text = {k: v[None] for k, v in texts[0].items()}
    latents = torch.randn(1, 8, 2, 2, generator=torch.Generator().manual_seed(2))
    adapter.training_loss(denoiser, latents, text, TRAIN, adapter.load_train_scheduler(), _gens(1)).backward()
    optimizer.step()  # lora_B leaves zero: the LoRA now changes the output
    file = adapter.save_lora(get_peft_model_state_dict(denoiser), tmp_path, peft_config(denoiser))

    pipe = _pipe(model)
    args = (torch.randn(1, 8, 2, 2, generator=torch.Generator().manual_seed(3)), torch.tensor([500.0]),
            text["prompt_embeds"], text["attention_mask"])
    with torch.no_grad():
        before = adapter.predict(pipe.transformer, *args)
        pipe.load_lora_weights(str(file))  # QwenImageLoraLoaderMixin, what load_sampler does
        assert sum("lora_A" in n for n in pipe.transformer.state_dict()) == 14
        after = adapter.predict(pipe.transformer, *args)
        trained = adapter.predict(denoiser, *args)
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, trained)  # the file's alpha / rank scale (2.0) is the trained one


def test_whole_dag_through_the_cli_on_the_demo_images(tmp_path):
    """validate -> cache_latents -> cache_text -> train -> sample -> report through `python -m flows.train
    model=tiny_qwenimage21` on the demo images at 32 px."""
    from conftest import cli_env

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.train", "model=tiny_qwenimage21", f"data.dir={REPO / 'data' / 'demo'}",
         "data.resolution=32", "train.max_steps=2", "sample.steps=2", "train.log_with=none",
         f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=cli_env(tmp_path / "prefect-home"), text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert {n: e["status"] for n, e in report["nodes"].items() if n != "caption"} == dict.fromkeys(
        ("validate", "cache_latents", "cache_text", "train", "sample"), "ran")
    assert all(np.isfinite(e["loss"]) for e in report["loss"])
    samples = report["artifacts"]["samples"]
    assert samples and all(s.endswith(".png") and Path(s).is_file() for s in samples)
    files = report["artifacts"]["lora_files"]
    # ComfyUI's model fuses the MLP input, musubi-tuner's does not: the ComfyUI file is apart from the kohya file
    assert set(files) == {"diffusers", "kohya", "comfyui"} and files["comfyui"] != files["kohya"]
    assert all(Path(f).is_file() for f in files.values())


# The kohya file: musubi-tuner's Qwen-Image 2.1 LoRA (kohya-ss/musubi-tuner at 960b2011ce7adcf554411aa0d4f696b6dc75f1de):
# - src/musubi_tuner/networks/lora_qwen_image_21.py, lines 11 and 14-35: networks.lora.create_network over every
#   QwenImage21TransformerBlock, prefix "lora_unet" (networks/lora.py: each Linear child one module named
#   `lora_unet_<path from the model, "." -> "_">`);
# - src/musubi_tuner/qwen_image_21/qwen_image_21_model.py (at 02b5088978d289407ec06deccf5189e8c275a00e), classes
#   SwiGLU (proj, gate_layer, out), Attention (to_q, to_k, to_v, to_out[0]), QwenImage21TransformerBlock (attn,
#   img_mlp) and the model's `transformer_blocks`: diffusers' names, so the file is loraflow's "named" layout.
MUSUBI_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.proj", "img_mlp.gate_layer",
                  "img_mlp.out")
# The ComfyUI file: the pinned diffusers 0.42.1 reads ComfyUI's Qwen-Image 2.1 single file with
# loaders/single_file_utils.py convert_qwen_image21_transformer_checkpoint_to_diffusers (lines 4404-4419): its keys
# are diffusers' (after an optional `model.diffusion_model.`), but "ComfyUI fuses the SwiGLU gate and up projections
# into a single GEMM, gate rows first": `img_mlp.gate_up` = [gate_layer; proj] (test_a_comfyui_single_file_... below).
# ComfyUI's comfy/ldm/qwen_image21/model.py itself is not in this workplace's code index (its ComfyUI
# snapshots predate it, and the repository is too large to fetch: 1.19 GB); its names were read from code that quotes
# or ports it: Forge's port ("from diffusers to ComfyUI to here", index file 69397004102: SwiGLUFeedForward
# `gate_up` when fused, `gate, up = self.gate_up(x).chunk(2, dim=-1)`; Attention to_q/to_k/to_v/to_out[0]), an MLX
# port "ported from comfy/ldm/qwen_image21/model.py" (index file 69292654287: "always fused=True for the real
# checkpoint"), Comfy-Org's released file's keys (index file 68782011514: `transformer_blocks.0.img_mlp.gate_up.weight`,
# `attn.to_q.weight`, ...) and a converter's check that "gate_up is gate_layer followed by proj" (index file
# 68360068662). comfy/lora.py model_lora_keys_unet (41444b5236c613ee5ff7d09aa620f94b702f30eb) maps
# `lora_unet_<k, "." -> "_">` for every `diffusion_model.<k>.weight`: restated by tests/support.py comfyui_merge.


def _comfy_keys(den) -> dict[str, tuple[int, int]]:
    keys = {}
    for name, m in den.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("transformer_blocks."):
            if name.endswith((".img_mlp.proj", ".img_mlp.gate_layer")):
                key = name.rsplit(".", 1)[0] + ".gate_up"
                keys[key] = (keys.get(key, (0, 0))[0] + m.out_features, m.in_features)
            else:
                keys[name] = (m.out_features, m.in_features)
    return keys


def _random_lora(adapter):
    from lora_fixtures import random_lora

    den = adapter.load_denoiser()
    keys = _comfy_keys(den)
    sd, _ = random_lora(den, adapter.default_lora_targets(), 4, 8)
    return den, keys, sd


def test_kohya_file_is_in_musubi_tuners_names(adapter):
    from tasks.training.export import to_kohya

    den, _, sd = _random_lora(adapter)
    file = to_kohya("qwenimage21", sd, 4, 8)
    musubi = {f"lora_unet_transformer_blocks_{i}_{m}".replace(".", "_"): f"transformer_blocks.{i}.{m}"
              for i in range(den.config.num_layers) for m in MUSUBI_LINEARS}
    assert {k.split(".")[0] for k in file} == set(musubi)
    for name, module in musubi.items():
        assert torch.equal(file[f"{name}.lora_down.weight"], sd[f"{module}.lora_A.weight"]), name
        assert torch.equal(file[f"{name}.lora_up.weight"], sd[f"{module}.lora_B.weight"]), name
        assert file[f"{name}.alpha"].item() == 8.0


def test_comfyui_file_is_mapped_completely_by_comfyui(adapter):
    """Every key of the ComfyUI file maps by ComfyUI's generic rule to a weight of its model of the right shape and
    merges to the PEFT deltas, gate_layer and proj as the row blocks of the fused gate_up (up block-diagonal, down
    stacked: exact up to float32 rounding of one product, support.REL); the kohya file leaves those two unread."""
    from support import REL, comfyui_merge

    from tasks.training.export import to_kohya
    from tasks.training.export_comfyui import comfyui_loads_kohya, comfyui_rows, to_comfyui

    den, keys, sd = _random_lora(adapter)
    merged = comfyui_merge("qwenimage21", to_comfyui("qwenimage21", sd, 4, 8), keys)
    assert set(merged) == set(keys) and any(k.endswith(".img_mlp.gate_up") for k in merged)
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    rows = comfyui_rows("qwenimage21", modules)
    for name, parts in rows.items():
        key = next(k for k in keys if k.replace(".", "_") == name)
        blocks = merged[key].split([dict(den.named_modules())[m].out_features for m in parts])
        assert parts[0].endswith(("gate_layer",)) or len(parts) == 1  # gate rows first
        for m, got in zip(parts, blocks):
            want = 2.0 * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double())
            assert (got - want).abs().max() <= REL * want.abs().max(), m
    assert sum(len(p) for p in rows.values()) == len(modules)
    assert not comfyui_loads_kohya("qwenimage21")
    with pytest.raises(AssertionError, match="lora key not loaded"):
        comfyui_merge("qwenimage21", to_kohya("qwenimage21", sd, 4, 8), keys)


def test_a_comfyui_single_file_converts_to_the_tiny_transformer(adapter, model, tmp_path):
    """model.path=<ComfyUI's single file>: the transformer in ComfyUI's layout (gate_up fused, gate rows first, the
    `model.diffusion_model.` prefix) converts through diffusers' from_single_file to the same weights."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(next((model / "transformer").glob("*.safetensors"))))
    comfy = {}
    for k, v in sd.items():
        if k.endswith("img_mlp.gate_layer.weight"):
            comfy["model.diffusion_model." + k.replace("gate_layer", "gate_up")] = torch.cat(
                [v, sd[k.replace("gate_layer", "proj")]])
        elif not k.endswith("img_mlp.proj.weight"):
            comfy["model.diffusion_model." + k] = v
    save_file(comfy, str(tmp_path / "qwen_image_2.1_tiny.safetensors"))
    adapter.convert_single_file(tmp_path / "qwen_image_2.1_tiny.safetensors", tmp_path / "out")
    got = load_file(str(next((tmp_path / "out" / "transformer").glob("*.safetensors"))))
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
