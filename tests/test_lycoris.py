"""Issue 30, item 3: LoHa and LoKr (`train.network=loha|lokr`) train through peft, sample, and export in the LyCORIS
layout that ComfyUI's own loader maps completely for every family, with the trained delta.

ComfyUI's rules, restated (it cannot be installed here; sources as quoted in this workplace's code index):
- Names: comfy/lora.py `model_lora_keys_unet` (index file 51926688842) registers `lycoris_<diffusers name, "." ->
  "_">` for SD1.5/SDXL (every name of comfy/utils.py `unet_to_diffusers`), SD3 (`mmdit_to_diffusers`), Flux and
  FLUX.2 (`flux_to_diffusers`, index file 51997534759, whose table has FLUX.2's `ff.linear_in/out` and
  `attn.to_qkv_mlp_proj` / `attn.to_out`; q/k/v map to row slices of the fused qkv), Qwen-Image (every key of
  its model, diffusers' names) and Z-Image (`z_image_to_diffusers`, index file 69316852822).
- Merge: comfy/lora.py `calculate_weight` (index file 23453667): LoHa (w1a @ w1b) * (w2a @ w2b) * alpha /
  w1b.shape[0]; LoKr kron(w1, w2) with w = a @ b where factorised, times alpha / dim where either is factorised
  (dim = its inner size) and 1 where both are full. A key outside the map is "lora key not loaded".
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from tasks import cache_latents, cache_text, publish, sample, train, validate
from tasks.config import compose, resolve_paths
from tasks.models import adapter_class
from tasks.store import Store
from tasks.models.lora_variants import lycoris
from tasks.training.export_lycoris import to_lycoris
from families import image_families
from tolerance import rounding

FAMILIES = image_families()  # every text-to-image family of the registry
_N = r"\.\d+\."
_FLUX = (rf"transformer_blocks{_N}(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|norm1(_context)?\.linear"
         rf"|ff(_context)?\.(net\.(0\.proj|2)|linear_(in|out)))"
         rf"|single_transformer_blocks{_N}(attn\.(to_[qkv]|to_qkv_mlp_proj|to_out)|proj_mlp|proj_out|norm\.linear)"
         r"|proj_out|x_embedder|context_embedder|norm_out\.linear|time_text_embed\.\w+\.linear_[12]")
COMFY_LYCORIS = {  # diffusers Linear names the `lycoris_` keys reach, per family (see the module's docstring)
    "flux": _FLUX, "flux_kontext": _FLUX, "flux2_klein": _FLUX, "flux2_dev": _FLUX,  # Kontext: ComfyUI's Flux model
    "sd3": rf"transformer_blocks{_N}(attn2?\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|ff(_context)?\.net\.(0\.proj|2)"
           r"|norm1(_context)?\.linear)|proj_out|context_embedder|time_text_embed\.\w+\.linear_[12]",
    "sdxl": r".*attentions\.\d+\.(proj_in|proj_out|transformer_blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ff\.net\.(0\.proj|2)))",
    "zimage": rf"(layers|context_refiner|noise_refiner){_N}(attention\.(to_[qkv]|to_out\.0)|feed_forward\.w[123]"
              r"|adaLN_modulation\.0)|x_embedder|final_layer\.linear",
    "qwenimage": r".+",  # its ComfyUI model has diffusers' names
    # ComfyUI maps no `lycoris_` name for Krea 2, only its generic `lora_unet_<model key>`: the file is in its model's
    # names (lycoris_names="comfyui"), every Linear of which has one (tests/test_krea2.py checks them on its source)
    "krea2": r".+",
    "chroma": _FLUX,  # ComfyUI's Chroma model is a Flux subclass (model_base.py): the Flux branch's names
    # ERNIE-Image: no `lycoris_` name either (no ErnieImage branch in model_lora_keys_unet); its model has diffusers'
    # names (comfy/ldm/ernie/model.py), so the generic `lora_unet_<key>` reaches every Linear (tests/test_ernie_image.py)
    "ernie_image": r".+",
    # Ideogram 4: no `lycoris_` name either; its ComfyUI model (comfy/ldm/ideogram4/model.py) has q/k/v as one
    # attention.qkv, the rest diffusers' names (tests/test_ideogram4.py): every Linear by the generic rule
    "ideogram4": r".+",
    # Qwen-Image 2.1: no `lycoris_` name known (ComfyUI's qwen_image21 source is not in the index); its model fuses the
    # MLP's gate_layer/proj into img_mlp.gate_up, the rest diffusers' names (tests/test_qwenimage21.py): the blocks'
    # Linears by the generic rule
    "qwenimage21": rf"transformer_blocks{_N}(attn\.(to_[qkv]|to_out\.0)|img_mlp\.(proj|gate_layer|out))",
    # Lumina 2: ComfyUI's Lumina2 branch names Z-Image's diffusers modules at equal q/k/v widths (not Lumina 2's GQA
    # rows); its generic `lora_unet_<model key>` reaches every block Linear (tests/test_lumina2.py cites the source)
    "lumina2": rf"(layers|noise_refiner|context_refiner){_N}(attn\.(to_[qkv]|to_out\.0)|feed_forward\.linear_[123]"
               r"|norm1\.linear)",
    # HiDream: its model_lora_keys_unet branch maps `lycoris_<model key>` (SimpleTuner's format) for every weight of
    # its ComfyUI model, which has diffusers' names (comfy/ldm/hidream/model.py; tests/test_hidream.py cites the lines)
    "hidream": r".+",
}
COMFY_LYCORIS["sd15"] = COMFY_LYCORIS["sdxl"]


def comfyui_merge(file: dict, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """{diffusers module: delta} as ComfyUI merges a LyCORIS file (float64); fails on a key it would not load."""
    groups: dict[str, dict] = {}
    for key, t in file.items():
        lyco, _, suffix = key.rpartition(".")
        assert lyco in names, f"ComfyUI would log 'lora key not loaded' for {key}"
        groups.setdefault(names[lyco], {})[suffix] = t.double()
    out = {}
    for module, v in groups.items():
        alpha = v.get("alpha")
        if "hada_w1_a" in v:
            scale = alpha.item() / v["hada_w1_b"].shape[0] if alpha is not None else 1.0
            out[module] = (v["hada_w1_a"] @ v["hada_w1_b"]) * (v["hada_w2_a"] @ v["hada_w2_b"]) * scale
        else:
            dim = None
            w1 = v.get("lokr_w1")
            if w1 is None:
                dim, w1 = v["lokr_w1_b"].shape[0], v["lokr_w1_a"] @ v["lokr_w1_b"]
            w2 = v.get("lokr_w2")
            if w2 is None:
                dim, w2 = v["lokr_w2_b"].shape[0], v["lokr_w2_a"] @ v["lokr_w2_b"]
            scale = alpha.item() / dim if alpha is not None and dim is not None else 1.0
            out[module] = torch.kron(w1, w2) * scale
    return out


def _denoiser(family, model_dir):
    adapter = adapter_class(family)(model_dir)
    return adapter, adapter.load_denoiser()


def _magnitude(parts: dict, scale: float) -> float:
    """The largest sum of |terms| in the delta: what its float32 rounding scales with."""
    a = {k: v.detach().double().abs() for k, v in parts.items()}
    if "hada_w1_a" in a:
        return scale * (a["hada_w1_a"] @ a["hada_w1_b"]).max().item() * (a["hada_w2_a"] @ a["hada_w2_b"]).max().item()
    w1 = a["lokr_w1"] if "lokr_w1" in a else a["lokr_w1_a"] @ a["lokr_w1_b"]
    w2 = a["lokr_w2"] if "lokr_w2" in a else a["lokr_w2_a"] @ a["lokr_w2_b"]
    return scale * w1.max().item() * w2.max().item()


@pytest.mark.parametrize("network", ["loha", "lokr"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lycoris_file_loads_every_key_in_comfyui_with_the_trained_delta(family, network, model_dirs):
    rank, alpha = 4, 6.0  # alpha / rank = 1.5: a scale that a loader applying 1 (or alpha) would get wrong
    adapter, den = _denoiser(family, model_dirs(family))
    if network == "lokr" and not adapter.lokr_file:  # declared: no exact LoKr file, so validate refuses it
        assert any(e.startswith("train.network=lokr:") for e in
                   validate.config_errors(_cfg(f"model=tiny_{family}", "train.network=lokr")))
        return
    linears = [n for n, m in den.named_modules() if isinstance(m, torch.nn.Linear)]  # before peft wraps them
    den.add_adapter(lycoris.make_config(network, rank, alpha, adapter.default_lora_targets()))
    comfy_names = adapter.kohya.lycoris_names == "comfyui"  # the file in ComfyUI's module names (Krea 2)
    if network == "lokr" and comfy_names:  # row blocks of one ComfyUI module share w2, as training ties them
        from tasks.training.export_lycoris import fused_groups  # (Ideogram 4's q/k/v: one attention.qkv)

        lycoris.share_w2(den, fused_groups(family, [n for n, m in den.named_modules() if hasattr(m, "get_delta_weight")]))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # as training leaves it: every factor non-zero (peft starts one at zero)
        for n, p in den.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in den.peft_config["default"].to_dict().items()}
    sd = get_peft_model_state_dict(den)
    file = to_lycoris(sd, config, family if comfy_names else None)

    mapped = [n for n in linears if re.fullmatch(COMFY_LYCORIS[family], n)]
    if comfy_names:
        from tasks.training.export_comfyui import comfyui_slots

        names = {"lora_unet_" + k: tuple(ms) for k, ms in comfyui_slots(family, mapped).items()}
    else:
        names = {"lycoris_" + n.replace(".", "_"): n for n in mapped}
    merged = comfyui_merge(file, names)
    if comfy_names:  # a ComfyUI module's delta: its row blocks, one per diffusers Linear (fused ones: several)
        out = {n: m.weight.shape[0] for n, m in den.named_modules() if n in linears}  # peft's layers too
        merged = {m: d for ms, delta in merged.items() for m, d in zip(ms, delta.split([out[m] for m in ms]))}
    layers = {n: m for n, m in den.named_modules() if hasattr(m, "get_delta_weight")}
    assert set(merged) == set(layers), sorted(set(merged) ^ set(layers))
    parts = lycoris.modules_of(sd, network)
    for name, layer in layers.items():
        want = layer.get_delta_weight("default").double()
        bound = rounding(rank, stages=3, magnitude=_magnitude(parts[name], alpha / rank))
        err = (merged[name] - want).abs().max().item()
        assert err <= bound, (name, err, bound)
        assert want.abs().max() > 0


def _cfg(*overrides):
    return resolve_paths(compose("train", list(overrides))[0])


def test_refusals_name_the_keys():
    assert not validate.config_errors(_cfg("train.network=lokr")) and not validate.config_errors(_cfg("train.network=loha"))
    assert any(e.startswith("train.network=loha with train.rslora=true")
               for e in validate.config_errors(_cfg("train.network=loha", "train.rslora=true")))
    assert any(e.startswith("train.network=lokr with train.text_encoder_lr")
               for e in validate.config_errors(_cfg("model=tiny_sd15", "train.network=lokr", "train.text_encoder_lr=1e-5")))


# SD1.5 LoHa also with what touches the network's file elsewhere: the EMA file, samples during training, fp8 base
EXTRA = ["train.ema_decay=0.9", "sample.every_n_steps=2", "model.storage_dtype=float8_e4m3fn"]


DAG = [("flux", "lokr", []), ("sd15", "loha", EXTRA), ("sd3", "loha", []), ("sdxl", "lokr", []),
       ("zimage", "lokr", []), ("qwenimage", "loha", []), ("flux2_klein", "lokr", []), ("flux2_dev", "loha", [])]


@pytest.mark.parametrize("family,network,extra", DAG, ids=[f"{f}-{n}" + ("-ema-fp8" if e else "") for f, n, e in DAG])
def test_dag_trains_samples_and_exports(family, network, extra, tmp_path):
    """Through the nodes: the LoRA trains (factors move), the sample node renders with it (not the base image),
    the run has one LyCORIS file as `lycoris` and `comfyui`, and that file put back on the model is the trained
    network: every module's delta equal to the train node's to float32 rounding."""
    root = tmp_path / "store"
    common = [f"store.root={root}", f"model=tiny_{family}", "train.batch_size=2", "train.max_steps=3", "train.lr=0.02",
              "train.log_with=none", "sample.steps=2", *extra]
    cfg = _cfg(*common, f"train.network={network}")
    store = Store(root)
    plan = validate.run(cfg, store)
    latents, texts = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, latents["items"], texts["items"])
    files = publish.publish(cfg, plan, store, tmp_path / "run", {**lora, "lora": lora["lora"]}, [])["lora_files"]
    assert set(files) == {"lycoris", "comfyui"} | ({"ema"} if extra else set())
    assert files["lycoris"] == files["comfyui"]
    if extra:  # the EMA weights in the same layout; samples rendered at step 2 through the live network
        assert load_file(files["ema"]).keys() == load_file(files["lycoris"]).keys()
        assert lora["checkpoint_samples"].get("2")
    exported = load_file(files["lycoris"])
    assert exported and all(k.startswith("lycoris_") for k in exported)
    assert lycoris.file_network(lora["lora"]) == network

    adapter = adapter_class(family)(plan.model_dir)
    trained, back = adapter.load_denoiser(), adapter.load_denoiser()
    lycoris.apply_file(trained, lora["lora"])
    lycoris.apply_lycoris(back, files["lycoris"])
    layers = {n: m for n, m in trained.named_modules() if hasattr(m, "get_delta_weight")}
    other = dict(back.named_modules())
    sd, config, _ = lycoris.read_peft(lora["lora"])
    parts = lycoris.modules_of(sd, network)
    # SD3's last block is context_pre_only: its context queries' output is discarded, so add_q_proj gets no
    # gradient (tiny SD3 has one block)
    unused = {"sd3": {"transformer_blocks.0.attn.add_q_proj"}}.get(family, set())
    moved = len(unused)
    for name, layer in layers.items():
        want = layer.get_delta_weight("default").double()
        got = other[name].get_delta_weight("default").double()
        moved += int(want.abs().max() > 0 and name not in unused)
        bound = rounding(config["r"], stages=3, magnitude=_magnitude(parts[name], config["alpha"] / config["r"]))
        assert (got - want).abs().max().item() <= bound, name
    assert moved == len(layers), [n for n, m in layers.items() if not m.get_delta_weight("default").abs().max() > 0]

    rendered = sample.run(cfg, plan, store, lora["key"], lora["lora"], texts["items"])["samples"]
    base = sample.run(cfg, plan, store, lora["key"] + "-base", _zero_like(lora["lora"], tmp_path), texts["items"])
    a, b = np.asarray(Image.open(rendered[0])), np.asarray(Image.open(base["samples"][0]))
    assert (a != b).any(), "the sample with the trained network equals the sample with a zero delta"


def _zero_like(path, tmp_path):
    """The train node's file with every factor zeroed but the config kept: the base model's render."""
    sd, config, component = lycoris.read_peft(path)
    return lycoris.save_peft(tmp_path / "zero.safetensors", {k: torch.zeros_like(v) for k, v in sd.items()}, config,
                             component)


@pytest.mark.parametrize("family", ["flux2_klein", "flux2_dev"])
def test_flux2_lokr_file_loads_in_diffusers_with_the_trained_delta(family, model_dirs):
    """diffusers' own FLUX.2 loader reads LyCORIS LoKr files (`_convert_lycoris_flux2_lokr_to_diffusers`, alpha
    baked as LyCORIS does): it runs here for real, and gives every module the trained delta."""
    rank, alpha = 4, 6.0
    model_dir = model_dirs(family)
    adapter, den = _denoiser(family, model_dir)
    den.add_adapter(lycoris.make_config("lokr", rank, alpha, adapter.default_lora_targets()))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in (p for p in den.parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in den.peft_config["default"].to_dict().items()}
    sd = get_peft_model_state_dict(den)
    pipe = adapter.pipeline_cls.from_pretrained(model_dir, text_encoder=None, tokenizer=None, vae=None)
    pipe.load_lora_weights(to_lycoris(sd, config))
    loaded = {n: m for n, m in pipe.transformer.named_modules() if hasattr(m, "get_delta_weight")}
    ours = {n: m for n, m in den.named_modules() if hasattr(m, "get_delta_weight")}
    assert set(loaded) == set(ours), sorted(set(loaded) ^ set(ours))
    parts = lycoris.modules_of(sd, "lokr")
    for name, layer in ours.items():
        want = layer.get_delta_weight("default").double()
        got = loaded[name].get_delta_weight(loaded[name].active_adapters[0])
        bound = rounding(rank, stages=3, magnitude=_magnitude(parts[name], alpha / rank))
        assert (got.double() - want).abs().max().item() <= bound, name
