"""docs/lora-files.md's "loads in" table, client by client, for the clients that cannot run here (ComfyUI, sd-scripts):
their key mapping and scale rule are mirrored below (file and function cited), every key of our files must map
to a real module of the family's model, and merging must give the trained LoRA's effect. diffusers' own loader
runs for real. Pinned: ComfyUI 0.3.64 (comfy/lora.py, comfy/weight_adapter/lora.py), sd-scripts main 2026-02.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ldm_convert import UNET_PREFIX, ldm_unet
from tasks.training.export import bake_alpha, save_diffusers, to_kohya
from lora_fixtures import TARGETS
from support import (ALPHA, RANK, comfyui_unet_key_map, load_pipeline, pipeline_denoiser, render_64,  # noqa: F401
                     render_peft_reference, trained_lora)
from tolerance import assert_close, render_sums


def comfyui_lora_key(file_key: str):
    """(module key, scale) as ComfyUI applies a PEFT-layout pair: LoRAAdapter.load takes `<x>.lora_B.weight`
    / `<x>.lora_A.weight`, alpha only from a `<x>.alpha` tensor; calculate_weight: scale = alpha / rank if
    alpha is not None else 1.0 (comfy/weight_adapter/lora.py). lora_adapter_metadata is never read."""
    return file_key.rsplit(".lora_", 1)[0]


# The diffusers Linears that comfy/utils.py flux_to_diffusers / mmdit_to_diffusers map (block Linears,
# embedders and the final layer; a subset written out here for the modules our LoRAs can target).
_B = r"transformer_blocks\.\d+\.(attn2?\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|ff(_context)?\.net\.(0\.proj|2)" \
     r"|norm1(_context)?\.linear)"
_COMFY_MAPPED = {
    "flux": _B + r"|single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp|proj_out|norm\.linear)"
                 r"|proj_out|x_embedder|context_embedder|time_text_embed\.\w+\.linear_[12]",
    "sd3": _B + r"|proj_out|context_embedder|time_text_embed\.\w+\.linear_[12]",
}


def comfyui_transformer_key_map(family, denoiser_names):
    """comfy/lora.py model_lora_keys_unet for Flux / SD3: `transformer.<diffusers name>` for every name
    flux_to_diffusers / mmdit_to_diffusers map (comfy/utils.py)."""
    return {f"transformer.{n}": n for n in denoiser_names if re.fullmatch(_COMFY_MAPPED[family], n)}


def _linears(pipe):
    return {n: m for n, m in pipeline_denoiser(pipe).named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.numerics
@pytest.mark.parametrize("family", ["flux", "sd3", "sdxl", "sd15"])
def test_diffusers_file_bakes_alpha_for_every_loader(family, model_dirs, tmp_path):
    """alpha != rank: diffusers (metadata) and ComfyUI (scale 1, metadata ignored) both give the trained LoRA."""
    assert ALPHA != RANK
    model_dir = model_dirs(family)
    sd, config = trained_lora(model_dir, TARGETS[family])
    ref = render_peft_reference(model_dir, sd, config, tmp_path / "src")  # writes src/pytorch_lora_weights
    dst = save_diffusers(tmp_path / "out" / "pytorch_lora_weights.safetensors",
                         tmp_path / "src" / "pytorch_lora_weights.safetensors")
    assert dst.read_bytes() == save_diffusers(tmp_path / "again.safetensors", tmp_path / "src" /
                                              "pytorch_lora_weights.safetensors").read_bytes()
    baked = load_file(dst)
    assert not any(k.endswith(".alpha") for k in baked)

    pipe = load_pipeline(model_dir)  # diffusers, for real
    pipe.load_lora_weights(str(dst.parent))
    bound = render_sums(pipe, steps=2)  # images in [0, 1]: magnitude 1
    assert_close(render_64(pipe), ref, magnitude=1.0, **bound, what=f"{family} diffusers")

    pipe = load_pipeline(model_dir)  # ComfyUI's rule, where its key map reads our keys (see docs/lora-files.md's table)
    linears = _linears(pipe)
    key_map = comfyui_transformer_key_map(family, linears) if family in ("flux", "sd3") else comfyui_unet_key_map(linears)
    modules = {comfyui_lora_key(k) for k in baked}
    if family in ("sdxl", "sd15"):  # `unet.<name>.to_k` is no ComfyUI key: docs/lora-files.md sends ComfyUI to kohya
        assert not modules & set(key_map)
        return
    assert modules <= set(key_map)
    with torch.no_grad():
        for x in modules:
            down, up = baked[f"{x}.lora_A.weight"], baked[f"{x}.lora_B.weight"]
            linears[key_map[x]].weight += 1.0 * (up @ down)  # no `<x>.alpha` -> scale 1
    assert_close(render_64(pipe), ref, magnitude=1.0, **bound, what=f"{family} comfyui merge")


def test_bake_alpha_scale_rules():
    a, b = torch.ones(8, 3), torch.ones(5, 8)
    sd = {"unet.x.lora_A.weight": a, "unet.x.lora_B.weight": b}
    meta = {"format": "pt", "lora_adapter_metadata": '{"unet.r": 8, "unet.lora_alpha": 4, "unet.use_rslora": false}'}
    out, m = bake_alpha(sd, meta)
    assert torch.equal(out["unet.x.lora_B.weight"], b * 0.5) and torch.equal(out["unet.x.lora_A.weight"], a)
    assert '"unet.lora_alpha": 8' in m["lora_adapter_metadata"] and m["loraflow_unet.trained_alpha"] == "4.0"
    meta["lora_adapter_metadata"] = '{"unet.r": 4, "unet.lora_alpha": 4, "unet.use_rslora": true}'
    assert torch.equal(bake_alpha(sd, meta)[0]["unet.x.lora_B.weight"], b * 2.0)  # rslora: alpha / sqrt(r)
    meta["lora_adapter_metadata"] = '{"unet.r": 4, "unet.lora_alpha": 4, "unet.rank_pattern": {"x": 2}}'
    with pytest.raises(ValueError, match="pattern"):
        bake_alpha(sd, meta)


def test_flux_kohya_never_writes_final_layer():
    """sd-scripts' networks/lora_flux.py LoRANetwork wraps only Linears inside DoubleStreamBlock and
    SingleStreamBlock (`lora_unet_double_blocks_*` / `lora_unet_single_blocks_*`), and its inference load is
    strict: a top-level proj_out (BFL final_layer.linear) LoRA is left out, with a warning."""
    a, b = torch.ones(RANK, 6), torch.ones(6, RANK)
    sd = {"proj_out.lora_A.weight": a, "proj_out.lora_B.weight": b,
          "single_transformer_blocks.0.proj_out.lora_A.weight": a,
          "single_transformer_blocks.0.proj_out.lora_B.weight": b}
    with pytest.warns(UserWarning, match="proj_out"):
        out = to_kohya("flux", sd, RANK, ALPHA)
    assert {k.split(".")[0] for k in out} == {"lora_unet_single_blocks_0_linear2"}


@pytest.mark.parametrize("family", ["flux", "flux_kontext", "sd3", "sdxl", "sd15"])
def test_kohya_keys_are_modules_of_comfyui_and_sd_scripts(family, model_dirs):
    """Every kohya module name is a `lora_unet_<original name, _>` of the family's checkpoint (ComfyUI's
    model_lora_keys_unet) and of sd-scripts' network: SGM names for SDXL (sdxl_original_unet), diffusers
    names for SD1.5 (networks/lora.py on diffusers' UNet), BFL double/single block Linears for Flux
    (networks/lora_flux.py; FLUX.1 Kontext's are Flux's: ComfyUI runs Kontext as its Flux model), SAI joint blocks
    for SD3 (networks/lora_sd3.py). Merges: tests/test_export.py."""
    model_dir = model_dirs(family)
    sd, _ = trained_lora(model_dir, TARGETS[family.replace("_kontext", "")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = {k.split(".")[0] for k in to_kohya(family, sd, RANK, ALPHA)}
    if family in ("sdxl", "sd15"):
        orig = {k.removeprefix(UNET_PREFIX)[: -len(".weight")] for k in ldm_unet(model_dir) if k.endswith(".weight")}
        den = {n for n in _linears(load_pipeline(model_dir))}
        allowed = set(comfyui_unet_key_map(den if family == "sd15" else (), orig if family == "sdxl" else ()))
        assert names and names <= allowed, sorted(names - allowed)
        return
    pattern = (r"lora_unet_(double_blocks_\d+_(img|txt)_(attn_(qkv|proj)|mlp_[02]|mod_lin)"
               r"|single_blocks_\d+_(linear[12]|modulation_lin))" if family.startswith("flux") else
               r"lora_unet_joint_blocks_\d+_(x|context)_block_(attn2?_(qkv|proj)|mlp_fc[12])")
    assert names and all(re.fullmatch(pattern, n) for n in names), sorted(names)
