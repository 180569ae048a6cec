"""Issue 30: the ComfyUI file of every family (report `artifacts.lora_files.comfyui`) is mapped completely by
ComfyUI's own loader: each key maps to a module of ComfyUI's model of the family, no key is left over ("lora key
not loaded"), and the weight delta ComfyUI merges equals the PEFT LoRA's.

ComfyUI's rules, restated here (it cannot be installed on these machines). The ComfyUI snapshot this
workplace's code index holds (comfy/lora.py at commit 41444b5236c613ee5ff7d09aa620f94b702f30eb, comfy/utils.py
at 2ba5cc8b867bc1aabe59fdaf0a8489e65012d603) predates its Z-Image and Qwen-Image support; the newer code was
read from copies of it quoted in the index (noted below), and from Comfy-Org's z_image_convert_original_to_comfy.py:
- `model_lora_keys_unet` (comfy/lora.py; the current one as quoted in index file 51926688842): for every
  key `diffusion_model.<k>.weight` of the model, `lora_unet_<k, "." -> "_">` maps to it (all families).
- `load_lora` (comfy/lora.py, 41444b5): module `x` is read from `x.lora_up.weight`, `x.lora_down.weight` and an
  optional `x.alpha`; every file key not read is logged as "lora key not loaded".
- comfy/weight_adapter/lora.py: W += (alpha / rank) * up @ down with rank = down.shape[0] (scale 1, no alpha).
- The model's keys. Z-Image (comfy/utils.py `z_image_to_diffusers`, quoted verbatim in index file
  69316852822; Comfy-Org's conversion script): diffusers' names, except that each block's attention.to_q /
  to_k / to_v are ONE `attention.qkv` (rows [0, h), [h, 2h), [2h, 3h)) and to_out.0 is `attention.out`.
  Qwen-Image: diffusers' names (model_lora_keys_unet's QwenImage branch maps `<k>` and `transformer.<k>` to
  `diffusion_model.<k>`). Flux, SD3, SDXL, SD1.5: their kohya file is the ComfyUI file; its names and merges
  against ComfyUI's flux/mmdit/unet maps are tests/test_export_clients.py's and tests/test_export.py's.
  FLUX.2: its kohya file, BFL names (diffusers' convert_flux2_transformer_checkpoint_to_diffusers table).
"""
from __future__ import annotations

import re

import pytest
import torch

from tasks.training.export import to_kohya
from tasks.training.export_comfyui import comfyui_loads_kohya, to_comfyui
from lora_fixtures import TARGETS
from support import ALPHA, RANK, load_pipeline, pipeline_denoiser, trained_lora  # noqa: F401
from support import REL, comfyui_merge  # noqa: F401 (shared helpers, tests/support.py)


def _comfy_zimage_keys(linears: dict[str, torch.nn.Linear]) -> dict[str, tuple[int, int]]:
    """ComfyUI's Z-Image model Linear weights (without `diffusion_model.`): {key: (out rows, in)}."""
    keys = {}
    for name, m in linears.items():
        if m_qkv := re.fullmatch(r"(.+\.attention)\.to_([qkv])", name):
            rows = keys.get(m_qkv.group(1) + ".qkv", (0, m.in_features))[0]
            keys[m_qkv.group(1) + ".qkv"] = (rows + m.out_features, m.in_features)
        else:
            keys[name.replace(".attention.to_out.0", ".attention.out")] = (m.out_features, m.in_features)
    return keys


def _comfy_split(family: str, key: str, delta: torch.Tensor, linears) -> dict[str, torch.Tensor]:
    """A delta on ComfyUI's module `key` -> {diffusers Linear: its rows of it} (z_image_to_diffusers' slices)."""
    if family == "zimage" and key.endswith(".attention.qkv"):
        base = key[: -len(".qkv")]
        names = [f"{base}.to_{s}" for s in "qkv"]
        return dict(zip(names, delta.split([linears[n].out_features for n in names])))
    if family == "zimage":
        return {key.replace(".attention.out", ".attention.to_out.0"): delta}
    return {key: delta}


def _peft_deltas(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    modules = {k.rsplit(".lora_", 1)[0] for k in sd}
    return {m: ALPHA / RANK * (sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double()) for m in modules}


@pytest.mark.parametrize("family", ["zimage", "qwenimage"])
def test_comfyui_file_loads_every_key_with_the_trained_delta(family, model_dirs):
    model_dir = model_dirs(family)
    sd, _ = trained_lora(model_dir, TARGETS[family])
    linears = {n: m for n, m in pipeline_denoiser(load_pipeline(model_dir)).named_modules() if isinstance(m, torch.nn.Linear)}
    comfy_keys = (_comfy_zimage_keys(linears) if family == "zimage" else
                  {n: (m.out_features, m.in_features) for n, m in linears.items()})
    file = to_comfyui(family, sd, RANK, ALPHA)
    merged = comfyui_merge(family, file, comfy_keys)

    expected = _peft_deltas(sd)
    got = {}
    for module, delta in merged.items():
        got.update(_comfy_split(family, module, delta, linears))
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for name, want in expected.items():
        err = (got[name] - want).abs().max().item()
        assert err <= REL * want.abs().max().item(), (name, err)
    if family == "zimage":  # every block's q/k/v are one module there: the reason this layout exists
        assert not any(".attention.to_" in k for k in merged) and any(k.endswith(".attention.qkv") for k in merged)
        assert not comfyui_loads_kohya("zimage")
    else:
        assert comfyui_loads_kohya(family) and file.keys() == to_kohya(family, sd, RANK, ALPHA).keys()


def test_zimage_kohya_file_is_what_comfyui_half_loads(model_dirs):
    """The issue's finding, pinned: ComfyUI's Z-Image model has no `attention.to_q`, so the kohya file (diffusers'
    names, for diffusers and musubi-tuner) leaves every attention projection unread there; the ComfyUI file does not."""
    model_dir = model_dirs("zimage")
    sd, _ = trained_lora(model_dir, TARGETS["zimage"])
    linears = {n: m for n, m in pipeline_denoiser(load_pipeline(model_dir)).named_modules() if isinstance(m, torch.nn.Linear)}
    with pytest.raises(AssertionError, match="lora key not loaded"):
        comfyui_merge("zimage", to_kohya("zimage", sd, RANK, ALPHA), _comfy_zimage_keys(linears))


@pytest.mark.parametrize("family", ["flux2_klein", "flux2_dev"])
def test_flux2_comfyui_file_is_the_kohya_file_in_bfl_names(family, model_dirs):
    """FLUX.2's checkpoints (and so ComfyUI's model) use BFL names: double_blocks.N.{img,txt}_attn.{qkv,proj},
    {img,txt}_mlp.{0,2}, single_blocks.N.linear{1,2} (diffusers' convert_flux2_transformer_checkpoint_to_diffusers).
    Not checked against ComfyUI's own code: the stored ComfyUI snapshot has no FLUX.2."""
    sd, _ = trained_lora(model_dirs(family), TARGETS[family])
    names = {k.split(".")[0] for k in to_comfyui(family, sd, RANK, ALPHA)}
    pattern = (r"lora_unet_(double_blocks_\d+_(img|txt)_(attn_(qkv|proj)|mlp_[02])|single_blocks_\d+_linear[12])")
    assert names and all(re.fullmatch(pattern, n) for n in names), sorted(names)
    assert comfyui_loads_kohya(family)


def _comfyui_dora(w: torch.Tensor, up, down, alpha, dora_scale) -> torch.Tensor:
    """comfy/weight_adapter/base.py weight_decompose (v0.3.77, as quoted in index file 59820945579), strength 1:
    a dora_scale of W's row count is on the output axis, where the norm is the BASE weight's rows (plus eps)."""
    calc = w + alpha / down.shape[0] * (up @ down)
    assert dora_scale.shape[0] == w.shape[0]  # the output-axis branch: the one loraflow's files use
    return calc * (dora_scale / (w.norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps))


@pytest.mark.parametrize("family", ["flux", "sd15", "zimage"])
def test_dora_file_merges_in_comfyui_as_trained(family, model_dirs):
    """train.network=dora: the kohya (Flux: fused qkv and linear1; SD1.5: UNet names) and ComfyUI (Z-Image: fused
    qkv) files carry `dora_scale`, and ComfyUI's rule gives PEFT's weight m * (W + dW) / |W + dW| row by row."""
    from peft import LoraConfig, get_peft_model_state_dict
    from lora_fixtures import MERGE_TABLE
    from support import comfyui_unet_key_map

    model_dir = model_dirs(family)
    den = pipeline_denoiser(load_pipeline(model_dir))
    targets = {"flux": ["to_q", "to_k", "to_v", "proj_mlp", "to_out.0"], "sd15": ["to_q", "to_k", "to_v", "to_out.0"],
               "zimage": TARGETS["zimage"]}[family]
    den.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, use_dora=True))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # as training leaves them: B non-zero, magnitudes moved off the base norms
        for name, p in den.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    sd = get_peft_model_state_dict(den)
    modules = dict(den.named_modules())
    base = lambda m: modules[m].base_layer.weight.detach()  # noqa: E731
    file = to_comfyui(family, sd, RANK, ALPHA, base=base) if family == "zimage" else to_kohya(family, sd, RANK, ALPHA, base=base)

    if family == "flux":  # the original checkpoint's Linear -> its diffusers row blocks (ComfyUI's flux_to_diffusers)
        rows = {f"lora_unet_{k}": v for k, v in MERGE_TABLE["flux"].items()}
    elif family == "sd15":
        rows = {k: [v] for k, v in comfyui_unet_key_map([n for n in modules if n.endswith((".to_q", ".to_k", ".to_v", ".to_out.0"))]).items()}
    else:
        rows = {}
        for key in {k.split(".")[0] for k in file}:
            comfy = key.removeprefix("lora_unet_")
            q = re.sub(r"_attention_qkv$", "_attention_to_", comfy)
            names = [n for n in modules if n.replace(".", "_") in ([q + s for s in "qkv"] if q != comfy else
                                                                     [comfy.replace("_attention_out", "_attention_to_out_0")])]
            rows[key] = sorted(names, key=lambda n: "qkv".find(n[-1]) if q != comfy else 0)
    got = {}
    for key in {k.split(".")[0] for k in file}:
        names = [n for n in rows[key] if n in modules and f"{n}.lora_A.weight" in sd]
        assert names, key
        w = torch.cat([base(n).double() for n in names])
        merged = _comfyui_dora(w, file[f"{key}.lora_up.weight"].double(), file[f"{key}.lora_down.weight"].double(),
                               file[f"{key}.alpha"].item(), file[f"{key}.dora_scale"].double())
        got.update(zip(names, merged.split([base(n).shape[0] for n in names])))
    trained = {k.rsplit(".lora_", 1)[0] for k in sd}
    assert set(got) == trained, sorted(set(got) ^ trained)
    for name in trained:
        w = base(name).double()
        calc = w + ALPHA / RANK * (sd[f"{name}.lora_B.weight"].double() @ sd[f"{name}.lora_A.weight"].double())
        want = calc * (sd[f"{name}.lora_magnitude_vector"].double() / calc.norm(dim=1))[:, None]
        # float64 throughout; the file's float32 dora_scale and factors: a few float32 roundings of the weight
        err = (got[name] - want).abs().max().item()
        assert err <= REL * want.abs().max().item(), (name, err)
