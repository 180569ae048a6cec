"""tasks/training/export.py: PEFT LoRA -> kohya .safetensors, checked for exactness against the PEFT/diffusers format.

Reference everywhere: the same LoRA saved with `<Pipeline>.save_lora_weights(..., *_lora_adapter_metadata=config)`
(so alpha is kept) and loaded with `load_lora_weights`. The kohya file must give the same image.

Loaders of the kohya file:
- "diffusers": `pipe.load_lora_weights(file)`, i.e. diffusers' own kohya converters. Used for SD1.5, SDXL and Flux.
  For Flux it covers everything except single-block linear1 (q|k|v|mlp) and top-level modules: diffusers'
  converter hard-codes FLUX.1's widths for linear1 (3*3072+12288, the tiny model is narrower) and drops
  img_in/txt_in (it emits them without the `transformer.` prefix). Those are covered by
  test_flux_layout_through_diffusers_at_flux1_dims and by the "merge" loader.
- "merge": what ComfyUI / sd-scripts do with a kohya file: W += alpha/rank * up @ down on the original
  (BFL / SAI) Linear, whose rows are the diffusers q/k/v(/mlp) weights stacked. diffusers' SD3 pipeline
  loads no kohya layout at all (it silently ignores the keys), so SD3 is only checked this way.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from safetensors import safe_open
from safetensors.torch import load_file

from tasks.training.export import kohya_metadata, save_kohya, to_kohya
from lora_fixtures import MERGE_TABLE, TARGETS
from tolerance import assert_close, render_sums, rounding
from support import ALPHA, RANK, load_pipeline, pipeline_denoiser, render_64, render_peft_reference, trained_lora  # noqa: F401 (shared helpers, tests/support.py)

# Everything diffusers' kohya Flux loader handles at any width (see module docstring).
FLUX_DIFFUSERS_TARGETS = (r"(transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)"
                          r"|ff(_context)?\.net\.(0\.proj|2)|norm1(_context)?\.linear)"
                          r"|single_transformer_blocks\.\d+\.(proj_out|norm\.linear))")


# lora_B's scale: the tiny Qwen-Image's VAE damps a LoRA at 0.1 to under 1e-2 of the image for some A draws
B_SCALE = {"qwenimage": 1.0}


def _merge_like_comfyui(pipe, kohya, table):
    modules = dict(pipeline_denoiser(pipe).named_modules())
    names = {k.split(".")[0] for k in kohya}
    assert {n.removeprefix("lora_unet_") for n in names} <= set(table), "module without a known original Linear"
    with torch.no_grad():
        for name in names:
            down, up = kohya[f"{name}.lora_down.weight"], kohya[f"{name}.lora_up.weight"]
            delta = kohya[f"{name}.alpha"].item() / down.shape[0] * (up @ down)
            targets = [modules[m] for m in table[name.removeprefix("lora_unet_")]]
            assert delta.shape == (sum(t.weight.shape[0] for t in targets), targets[0].weight.shape[1])
            for t, rows in zip(targets, torch.split(delta, [t.weight.shape[0] for t in targets])):
                t.weight += rows


@pytest.mark.numerics
@pytest.mark.parametrize("family,loader", [("sd15", "diffusers"), ("sdxl", "diffusers"), ("flux", "diffusers"),
                                           ("flux", "merge"), ("sd3", "merge"), ("zimage", "diffusers"),
                                           ("qwenimage", "diffusers"), ("flux2_klein", "diffusers"),
                                           ("flux2_dev", "diffusers")])
def test_kohya_export_reproduces_peft_lora(family, loader, model_dirs, tmp_path):
    model_dir = model_dirs(family)
    targets = FLUX_DIFFUSERS_TARGETS if (family, loader) == ("flux", "diffusers") else TARGETS[family]
    sd, config = trained_lora(model_dir, targets, B_SCALE.get(family, 0.1))
    meta = kohya_metadata(family, RANK, ALPHA, ss_steps=10, ss_dataset_hash="abc", loraflow_base_model="sha256:0")
    file = save_kohya(tmp_path / "out" / "lora.safetensors", family, sd, RANK, ALPHA, meta)

    kohya = load_file(file)
    assert kohya and all(k.startswith("lora_unet_") for k in kohya)
    assert all(k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in kohya)
    assert all(v.ndim == 0 for k, v in kohya.items() if k.endswith(".alpha"))
    with safe_open(str(file), "pt") as f:
        assert f.metadata() == meta
    if family == "sdxl":  # sd-scripts' SDXL naming, all three block kinds present
        assert {k.split("_")[2] for k in kohya} == {"input", "middle", "output"}

    base = render_64(load_pipeline(model_dir))
    # The kohya file leaves out Flux's top-level proj_out (tests/test_export_clients.py): so does the reference.
    ref_sd = {k: v for k, v in sd.items() if not k.startswith("proj_out.")} if family == "flux" else sd
    ref = render_peft_reference(model_dir, ref_sd, config, tmp_path / "peft")
    pipe = load_pipeline(model_dir)
    if loader == "diffusers":
        pipe.load_lora_weights(str(file))
    else:
        _merge_like_comfyui(pipe, kohya, MERGE_TABLE[family])
    out = render_64(pipe)

    bound = render_sums(pipe, steps=2)  # images in [0, 1]: magnitude 1
    assert np.abs(ref - base).max() > rounding(**bound), "the LoRA should change the image beyond rounding"
    assert_close(out, ref, magnitude=1.0, **bound, what=f"{family} {loader} render")


@pytest.mark.numerics
def test_flux_layout_through_diffusers_at_flux1_dims():
    """The fused layouts at FLUX.1's real widths, through diffusers' own kohya converter (no model needed):
    single-block linear1 (q|k|v|mlp), partly trained groups (zero-filled slots) and a non-power-of-2 scale."""
    d, rank, alpha, gen = 3072, 2, 3.0, torch.Generator().manual_seed(0)
    shapes = {f"transformer_blocks.0.attn.{m}": (d, d) for m in ("to_q", "to_k", "to_v", "add_q_proj", "add_v_proj")}
    shapes |= {f"single_transformer_blocks.0.attn.{m}": (d, d) for m in ("to_q", "to_k", "to_v")}
    shapes |= {"single_transformer_blocks.0.proj_mlp": (4 * d, d), "single_transformer_blocks.1.attn.to_v": (d, d)}
    sd = {}
    for m, (out_dim, in_dim) in shapes.items():
        sd[f"{m}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen, dtype=torch.float64)
        sd[f"{m}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen, dtype=torch.float64)

    kohya = to_kohya("flux", sd, rank, alpha)
    assert kohya["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape == (7 * d, 4 * rank)
    assert kohya["lora_unet_single_blocks_0_linear1.alpha"].item() == 4 * alpha
    conv = FluxPipeline.lora_state_dict(kohya)  # diffusers: alpha folded in, i.e. loaded at scale 1

    x = torch.randn(d, 3, generator=gen, dtype=torch.float64)  # float64: compare the maths, not fp32 rounding
    for m in shapes:
        a, b = conv[f"transformer.{m}.lora_A.weight"], conv[f"transformer.{m}.lora_B.weight"]
        expected = alpha / rank * sd[f"{m}.lora_B.weight"] @ (sd[f"{m}.lora_A.weight"] @ x)
        assert_close(b @ (a @ x), expected, n=d, stages=3, what=m)  # two products of width d and rank, one scale
    # Untrained members of a fused group come back as exact zeros.
    for m in ("transformer_blocks.0.attn.add_k_proj", "single_transformer_blocks.1.attn.to_q",
              "single_transformer_blocks.1.proj_mlp"):
        assert not conv[f"transformer.{m}.lora_B.weight"].any()


def test_kohya_metadata_strings_and_sd_scripts_keys():
    meta = kohya_metadata("flux", 16, 8, ss_steps=100, ss_network_dim="999", tags=["a", "b"], loraflow_base_model="x")
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["ss_network_module"] == "networks.lora_flux" and meta["ss_base_model_version"] == "flux1"
    assert meta["ss_network_dim"] == "16" and meta["ss_network_alpha"] == "8.0"  # describe the tensors: not overridable
    assert meta["ss_steps"] == "100" and meta["tags"] == '["a", "b"]' and meta["loraflow_base_model"] == "x"
    assert kohya_metadata("sdxl", 4, 4)["ss_base_model_version"] == "sdxl_base_v1-0"
    assert kohya_metadata("sd15", 4, 4)["ss_network_module"] == "networks.lora"
    with pytest.raises(ValueError):
        kohya_metadata("sd2", 4, 4)


def _tiny_sd15_lora():
    gen = torch.Generator().manual_seed(0)
    m = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    return {f"{m}.lora_A.weight": torch.randn(4, 8, generator=gen),
            f"{m}.lora_B.weight": torch.randn(8, 4, generator=gen)}


def test_save_kohya_replaces_atomically(tmp_path, monkeypatch):
    path, sd = tmp_path / "lora.safetensors", _tiny_sd15_lora()
    save_kohya(path, "sd15", sd, 4, 8, {"v": "1"})
    save_kohya(path, "sd15", sd, 4, 8, {"v": "2"})
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"v": "2"}

    def crash(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr("safetensors.torch.save_file", crash)  # what tasks.training.export writes with
    with pytest.raises(OSError):
        save_kohya(path, "sd15", sd, 4, 8, {"v": "3"})
    with safe_open(str(path), "pt") as f:  # the old file is intact and no temp file is left behind
        assert f.metadata() == {"v": "2"}
    assert [p.name for p in tmp_path.iterdir()] == ["lora.safetensors"]
    with pytest.raises(TypeError):
        save_kohya(path, "sd15", sd, 4, 8, {"steps": 3})


def test_to_kohya_refuses_what_it_cannot_express():
    with pytest.raises(ValueError, match="family"):
        to_kohya("sd2", _tiny_sd15_lora(), 4, 8)
    with pytest.raises(ValueError, match="rank"):
        to_kohya("sd15", _tiny_sd15_lora(), 8, 8)
    a, b = torch.zeros(4, 8), torch.zeros(16, 4)
    with pytest.raises(ValueError, match="norm_out"):  # AdaLN output has shift/scale swapped vs BFL: not mapped
        to_kohya("flux", {"norm_out.linear.lora_A.weight": a, "norm_out.linear.lora_B.weight": b}, 4, 8)
    with pytest.raises(ValueError, match="plain LoRA"):
        to_kohya("sd3", {"transformer_blocks.0.attn.to_q.lora_bias.weight": a[0]}, 4, 8)
    dora = {"transformer_blocks.0.attn.to_q.lora_A.weight": a, "transformer_blocks.0.attn.to_q.lora_B.weight": b,
            "transformer_blocks.0.attn.to_q.lora_magnitude_vector": b[:, 0]}
    with pytest.raises(ValueError, match="base model's weights"):  # DoRA's dora_scale needs the base weights
        to_kohya("sd3", dora, 4, 8)
