"""Export a trained PEFT LoRA as a kohya-style .safetensors: the format ComfyUI, A1111/Forge and sd-scripts load.

Kohya layout: one entry per *original-checkpoint* Linear, `<name>.lora_down.weight` (rank x in),
`<name>.lora_up.weight` (out x rank) and a scalar `<name>.alpha`; the loader applies
W += (alpha / rank) * up @ down. Names per family are the ones sd-scripts writes:

- sd15: `lora_unet_<diffusers name>` (sd-scripts' SD1 UNet uses diffusers module names), via diffusers'
  own `convert_state_dict_to_kohya`. A text-encoder LoRA (train.text_encoder_lr) is `lora_te_<transformers
  name>` (`lora_te_text_model_encoder_layers_0_self_attn_q_proj`), SDXL's two `lora_te1_` / `lora_te2_`: the
  names sd-scripts' networks.lora writes, which diffusers' `_convert_non_diffusers_lora_to_diffusers` reads.
- sdxl: the same converter, then SGM block names (`input_blocks_4_1_...`), as sd-scripts' SDXL LoRAs use;
  A1111, ComfyUI and diffusers (`_maybe_map_sgm_blocks_to_diffusers`) load them.
- flux: BFL names (`lora_unet_double_blocks_0_img_attn_qkv`, `..._single_blocks_0_linear1`), i.e.
  networks.lora_flux's layout, loaded by sd-scripts, ComfyUI, Forge and diffusers' `FluxPipeline` (whose
  converter assumes FLUX.1's widths for single-block linear1 and drops img_in/txt_in). A LoRA on the top-level
  `proj_out` (BFL `final_layer.linear`) is left out with a warning: networks.lora_flux has no such module and
  sd-scripts' strict load refuses the key.
- sd3: SAI MMDiT names (`lora_unet_joint_blocks_0_x_block_attn_qkv`), networks.lora_sd3's layout, loaded
  by sd-scripts and ComfyUI. diffusers' `StableDiffusion3Pipeline` loads NO kohya layout (its
  `lora_state_dict` does no conversion), so an SD3 export cannot be loaded back with diffusers.
- zimage: `lora_unet_<diffusers module name, dots as underscores>` (`lora_unet_layers_0_attention_to_q`,
  `..._feed_forward_w1`): the kohya-prefixed layout of the Z-Image trainers that keep diffusers' module
  tree, which diffusers' `ZImagePipeline` converts (`_convert_non_diffusers_z_image_lora_to_diffusers`,
  alpha applied). ComfyUI's native Z-Image names fuse q/k/v (`attention.qkv`): export_comfyui.py writes that layout.
- flux2_klein: BFL FLUX.2 names (`lora_unet_double_blocks_0_img_attn_qkv` fused as for Flux,
  `..._single_blocks_0_linear1` = diffusers' already fused `to_qkv_mlp_proj`), which diffusers'
  `Flux2KleinPipeline` converts (`_convert_kohya_flux2_lora_to_diffusers`).
- flux2_dev: the same names (the same transformer), which `Flux2Pipeline` converts with the same converter.
- qwenimage: the same rule (`lora_unet_transformer_blocks_0_attn_to_q`), musubi-tuner's Qwen-Image layout,
  which diffusers' `QwenImagePipeline` converts (`_convert_non_diffusers_qwen_lora_to_diffusers`).
- qwenimage_edit: the same (Qwen-Image-Edit is Qwen-Image's transformer; its pipelines share the loader).
- wan: Wan's original names (`lora_unet_blocks_0_self_attn_q`, `..._cross_attn_o`, `..._ffn_0`): musubi-tuner's
  networks.lora_wan layout, which diffusers' `WanPipeline` converts (`_convert_musubi_wan_lora_to_diffusers`,
  which expects all ten Linears of every block: the family's default targets) and ComfyUI maps by its generic
  `lora_unet_<model key>` rule (its Wan model keeps the original names).
- ltx2: `lora_unet_<diffusers module name, dots as underscores>` (`lora_unet_transformer_blocks_0_attn1_to_q`,
  `..._ff_net_0_proj`): for the video stream's modules diffusers' names are LTX-2's original (ltx-core) ones, which
  ComfyUI's LTXAV model keeps (its generic `lora_unet_<model key>` rule maps them) and the musubi-tuner LTX-2
  forks' networks.lora_ltx2 writes. diffusers' `LTX2Pipeline` loads NO kohya layout (its converter reads only
  ltx-trainer's `diffusion_model.`-prefixed PEFT keys): use the diffusers file there.
- hunyuan_video15: ComfyUI's names for its HunyuanVideo 1.5 model, which builds its double blocks from Flux's
  DoubleStreamBlock (`lora_unet_double_blocks_0_img_attn_qkv` fused as for Flux, `..._img_attn_proj`,
  `..._img_mlp_0` / `_2`, `..._txt_*`, `..._img_mod_lin`), so its generic `lora_unet_<model key>` rule maps them
  (tests/test_hunyuan_video15.py). The original checkpoint (and musubi-tuner's networks.lora_hv_1_5) has q/k/v
  apart and `img_mlp.fc1` / `fc2` (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py): musubi-tuner does
  not read this file, and diffusers 0.42.1 has no HunyuanVideo 1.5 LoRA loader: use the diffusers file there.

Pure core: no prefect/hydra imports.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from pathlib import Path

from tasks.store.stored_files import canonicalize_safetensors
from tasks.training.dora_export import dora_scales, split_dora
from tasks.lazy import lazy

torch = lazy("torch")
state_dict_utils = lazy("diffusers.utils.state_dict_utils")
safetensors = lazy("safetensors")
st = lazy("safetensors.torch")

FAMILIES = ("flux", "flux_kontext", "sd3", "sdxl", "sd15", "zimage", "qwenimage", "qwenimage_edit", "flux2_klein",
            "flux2_dev", "wan", "wan22", "ltx2", "hunyuan_video15")
LORA_META = "lora_adapter_metadata"  # diffusers' key for the peft config(s), "<component>.<field>"
CODE_VERSION = "4"  # bump when the key mapping, scaling or metadata changes: stored exports are re-derived

# diffusers module (full match) -> (kohya module, group size). Group size > 1: the original checkpoint has
# ONE fused Linear (qkv, or Flux's single-block linear1 = q|k|v|mlp) where diffusers has several; the slot
# within the group is named by the regex's second group (see _SLOT).
_B, _S = r"transformer_blocks\.(\d+)\.", r"single_transformer_blocks\.(\d+)\."
_RULES = {
    "flux": [
        (_B + r"attn\.to_([qkv])", "double_blocks_{}_img_attn_qkv", 3),
        (_B + r"attn\.add_([qkv])_proj", "double_blocks_{}_txt_attn_qkv", 3),
        (_B + r"attn\.to_out\.0", "double_blocks_{}_img_attn_proj", 1),
        (_B + r"attn\.to_add_out", "double_blocks_{}_txt_attn_proj", 1),
        (_B + r"ff\.net\.0\.proj", "double_blocks_{}_img_mlp_0", 1),
        (_B + r"ff\.net\.2", "double_blocks_{}_img_mlp_2", 1),
        (_B + r"ff_context\.net\.0\.proj", "double_blocks_{}_txt_mlp_0", 1),
        (_B + r"ff_context\.net\.2", "double_blocks_{}_txt_mlp_2", 1),
        (_B + r"norm1\.linear", "double_blocks_{}_img_mod_lin", 1),
        (_B + r"norm1_context\.linear", "double_blocks_{}_txt_mod_lin", 1),
        (_S + r"attn\.to_([qkv])", "single_blocks_{}_linear1", 4),
        (_S + r"(proj_mlp)", "single_blocks_{}_linear1", 4),
        (_S + r"proj_out", "single_blocks_{}_linear2", 1),
        (_S + r"norm\.linear", "single_blocks_{}_modulation_lin", 1),
        (r"x_embedder", "img_in", 1),
        (r"context_embedder", "txt_in", 1),
    ],
    "sd3": [
        (_B + r"attn\.to_([qkv])", "joint_blocks_{}_x_block_attn_qkv", 3),
        (_B + r"attn\.add_([qkv])_proj", "joint_blocks_{}_context_block_attn_qkv", 3),
        (_B + r"attn\.to_out\.0", "joint_blocks_{}_x_block_attn_proj", 1),
        (_B + r"attn\.to_add_out", "joint_blocks_{}_context_block_attn_proj", 1),
        (_B + r"attn2\.to_([qkv])", "joint_blocks_{}_x_block_attn2_qkv", 3),  # SD3.5 (MMDiT-X) dual attention
        (_B + r"attn2\.to_out\.0", "joint_blocks_{}_x_block_attn2_proj", 1),
        (_B + r"ff\.net\.0\.proj", "joint_blocks_{}_x_block_mlp_fc1", 1),
        (_B + r"ff\.net\.2", "joint_blocks_{}_x_block_mlp_fc2", 1),
        (_B + r"ff_context\.net\.0\.proj", "joint_blocks_{}_context_block_mlp_fc1", 1),
        (_B + r"ff_context\.net\.2", "joint_blocks_{}_context_block_mlp_fc2", 1),
    ],
}
_RULES["flux2_klein"] = [  # BFL FLUX.2 names, as diffusers' _convert_kohya_flux2_lora_to_diffusers reads them
    (_B + r"attn\.to_([qkv])", "double_blocks_{}_img_attn_qkv", 3),
    (_B + r"attn\.add_([qkv])_proj", "double_blocks_{}_txt_attn_qkv", 3),
    (_B + r"attn\.to_out\.0", "double_blocks_{}_img_attn_proj", 1),
    (_B + r"attn\.to_add_out", "double_blocks_{}_txt_attn_proj", 1),
    (_B + r"ff\.linear_in", "double_blocks_{}_img_mlp_0", 1),
    (_B + r"ff\.linear_out", "double_blocks_{}_img_mlp_2", 1),
    (_B + r"ff_context\.linear_in", "double_blocks_{}_txt_mlp_0", 1),
    (_B + r"ff_context\.linear_out", "double_blocks_{}_txt_mlp_2", 1),
    (_S + r"attn\.to_qkv_mlp_proj", "single_blocks_{}_linear1", 1),  # already one fused Linear in diffusers
    (_S + r"attn\.to_out", "single_blocks_{}_linear2", 1),
]
_W = r"blocks\.(\d+)\."
_RULES["wan"] = [  # diffusers' WanTransformer3DModel -> Wan's original module names (musubi-tuner's, ComfyUI's)
    (_W + r"attn1\.to_q", "blocks_{}_self_attn_q", 1), (_W + r"attn1\.to_k", "blocks_{}_self_attn_k", 1),
    (_W + r"attn1\.to_v", "blocks_{}_self_attn_v", 1), (_W + r"attn1\.to_out\.0", "blocks_{}_self_attn_o", 1),
    (_W + r"attn2\.to_q", "blocks_{}_cross_attn_q", 1), (_W + r"attn2\.to_k", "blocks_{}_cross_attn_k", 1),
    (_W + r"attn2\.to_v", "blocks_{}_cross_attn_v", 1), (_W + r"attn2\.to_out\.0", "blocks_{}_cross_attn_o", 1),
    (_W + r"ffn\.net\.0\.proj", "blocks_{}_ffn_0", 1),
    (_W + r"ffn\.net\.2", "blocks_{}_ffn_2", 1),
]
_RULES["wan22"] = _RULES["wan"]  # each Wan 2.2 expert is a Wan 2.1 transformer: one LoRA file per expert
# HunyuanVideo 1.5: diffusers' double-stream block has Flux's module names (transformer_blocks.N.attn.to_q ...,
# ff.net.0.proj, norm1.linear) and ComfyUI's model Flux's DoubleStreamBlock (img_attn.qkv, img_mlp.0, img_mod.lin):
# Flux's double-block rules (no single blocks, no img_in/txt_in: HunyuanVideo's embedders are no LoRA targets)
_RULES["hunyuan_video15"] = [r for r in _RULES["flux"] if r[0].startswith(_B)]
_RULES["flux_kontext"] = _RULES["flux"]  # FLUX.1 Kontext: FLUX.1's transformer, the same BFL names
_RULES["flux2_dev"] = _RULES["flux2_klein"]  # the same transformer; Flux2Pipeline reads the same converter
_SLOT = {"q": 0, "k": 1, "v": 2, "proj_mlp": 3}
# Output width of each slot relative to q's: Flux's single block has mlp_ratio 4 (hard-wired in BFL's and
# diffusers' code: linear1 = 3 * 3072 + 12288). Used to zero-fill slots that were not trained.
_SLOT_WIDTH = (1, 1, 1, 4)
# Modules no kohya loader of the family has (sd-scripts' strict load fails on them): left out, with a warning.
_DROP = {"flux": r"proj_out", "flux_kontext": r"proj_out"}

_META = {"flux": ("networks.lora_flux", "flux1"), "flux_kontext": ("networks.lora_flux", "flux1"), "sd3": ("networks.lora_sd3", "sd3"),
         "sdxl": ("networks.lora", "sdxl_base_v1-0"), "sd15": ("networks.lora", "sd_v1"),
         "zimage": ("networks.lora_zimage", "zimage"), "qwenimage": ("networks.lora_qwen_image", "qwen_image"),
         "qwenimage_edit": ("networks.lora_qwen_image", "qwen_image_edit"),
         "flux2_klein": ("networks.lora_flux2", "flux2_klein"), "flux2_dev": ("networks.lora_flux2", "flux2_dev"),
         "wan": ("networks.lora_wan", "wan2.1"), "wan22": ("networks.lora_wan", "wan2.2"),
         "ltx2": ("networks.lora_ltx2", "ltx2"), "hunyuan_video15": ("networks.lora_hv_1_5", "hunyuan_video_1_5")}
# Families whose kohya names are the diffusers module names with "." -> "_" (one Linear per module).
_NAMED = ("zimage", "qwenimage", "qwenimage_edit", "ltx2")
# Text-encoder LoRAs (train.text_encoder_lr): sd-scripts' prefix per pipeline component (SD1 has one encoder)
_TE_PREFIX = {"sd15": {"text_encoder": "lora_te"}, "sdxl": {"text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}}


def named_layout(family: str) -> bool:
    """Whether the family's kohya names are its diffusers module names, dots as underscores (one Linear each)."""
    return check_family(family) in _NAMED


def check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return family


def kohya_rows(family: str, module_names) -> dict[str, list[str]]:
    """kohya module (without `lora_unet_`) -> the diffusers Linears of `module_names` that are its row blocks, in
    order (q, k, v(, mlp)): what a loader merging a kohya file onto a diffusers model needs (ComfyUI's
    flux_to_diffusers map, read backwards). Families with `_RULES` only."""
    rows: dict[str, dict[int, str]] = {}
    for module in module_names:
        for pattern, name, size in _RULES[check_family(family)]:
            if m := re.fullmatch(pattern, module):
                rows.setdefault(name.format(*m.groups()[:1]), {})[_SLOT[m.group(2)] if size > 1 else 0] = module
                break
    return {name: [slots[i] for i in sorted(slots)] for name, slots in rows.items()}


def lora_pairs(sd: dict[str, torch.Tensor], rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT `x.lora_A.weight`/`x.lora_B.weight` -> {x: (A, B)}; anything else (DoRA, lora bias) is refused."""
    out = {}
    for key, a in sd.items():
        if key.endswith(".lora_B.weight"):
            continue
        if not key.endswith(".lora_A.weight"):
            raise ValueError(f"not a plain LoRA key: {key}")
        module = key[: -len(".lora_A.weight")]
        if a.shape[0] != rank:  # the single alpha/rank scale below is only right if every module has this rank
            raise ValueError(f"{module}: rank {a.shape[0]} != {rank}")
        out[module] = (a, sd[f"{module}.lora_B.weight"])
    return out


def _transformer_to_kohya(family, pairs, rank, alpha):
    groups: dict[str, tuple[int, dict[int, tuple]]] = {}
    if dropped := sorted(m for m in pairs if re.fullmatch(_DROP.get(family, "(?!)"), m)):
        warnings.warn(f"{family}: kohya file leaves out {dropped} (no such module in sd-scripts' {family} LoRA)")
        pairs = {m: ab for m, ab in pairs.items() if m not in dropped}
    for module, ab in pairs.items():
        for pattern, name, size in _RULES[family]:
            m = re.fullmatch(pattern, module)
            if m:
                slot = _SLOT[m.group(2)] if size > 1 else 0
                groups.setdefault(name.format(*m.groups()[:1]), (size, {}))[1][slot] = ab
                break
        else:
            raise ValueError(f"{family}: no kohya name for LoRA module {module!r}")

    out = {}
    for name, (size, slots) in groups.items():
        if size == 1:
            (down, up), a = slots[0], alpha
        else:
            # Fuse into the checkpoint's single Linear, exactly: down = [A_q; A_k; A_v(; A_mlp)] stacked
            # (size*rank x in), up = block-diagonal diag(B_q, B_k, B_v(, B_mlp)) (sum(out) x size*rank), so
            # up @ down = [B_q A_q; B_k A_k; ...] with no cross terms. The rank is now size*rank, so alpha is
            # scaled by size to keep alpha/rank (as sd-scripts does, kohya-ss/sd-scripts#2204). Untrained
            # slots get zeros, which keeps the block structure diffusers' converter detects as "sparse".
            i0, (a0, b0) = next(iter(slots.items()))
            unit = b0.shape[0] // _SLOT_WIDTH[i0]
            parts = [slots.get(i) or (a0.new_zeros(a0.shape), b0.new_zeros(unit * _SLOT_WIDTH[i], rank))
                     for i in range(size)]
            down = torch.cat([p[0] for p in parts])
            up = torch.block_diag(*[p[1] for p in parts])
            a = alpha * size
        out[f"lora_unet_{name}.lora_down.weight"] = down.contiguous()
        out[f"lora_unet_{name}.lora_up.weight"] = up.contiguous()
        out[f"lora_unet_{name}.alpha"] = torch.tensor(float(a))
    return out


def _sgm_name(key: str) -> str | None:
    """diffusers UNet attention-block name -> SGM (`input_blocks`/`middle_block`/`output_blocks`) name.
    SDXL's UNet has layers_per_block 2, so an input block spans 3 SGM indices (2 layers + downsampler)."""
    if m := re.match(r"lora_unet_down_blocks_(\d+)_attentions_(\d+)_(.*)", key):
        return f"lora_unet_input_blocks_{1 + 3 * int(m[1]) + int(m[2])}_1_{m[3]}"
    if m := re.match(r"lora_unet_up_blocks_(\d+)_attentions_(\d+)_(.*)", key):
        return f"lora_unet_output_blocks_{3 * int(m[1]) + int(m[2])}_1_{m[3]}"
    if m := re.match(r"lora_unet_mid_block_attentions_0_(.*)", key):
        return f"lora_unet_middle_block_1_{m[1]}"
    return None


def _unet_to_kohya(family, peft_state_dict, alpha):
    out = state_dict_utils.convert_state_dict_to_kohya({f"unet.{k}": v for k, v in peft_state_dict.items()})
    # diffusers writes alpha = rank (scale 1), right only when alpha == rank: store the trained alpha.
    out = {k: torch.tensor(float(alpha)) if k.endswith(".alpha") else v.contiguous() for k, v in out.items()}
    if family == "sdxl":
        sgm = {k: _sgm_name(k) for k in out}
        # Only attention blocks are renamed; with any other module (resnets, conv_in, ...) keep diffusers
        # names throughout, because diffusers drops the SGM keys of a file that mixes both namings.
        if all(sgm.values()):
            out = {sgm[k]: v for k, v in out.items()}
    return out


def _unet_kohya_names(family, pairs, alpha) -> dict[str, list[str]]:
    """kohya module -> [the UNet module it is]: diffusers' converter renames keys one by one, so each module's
    name is that of a one-module file, with the SGM renaming decided on the whole set as `_unet_to_kohya` does."""
    names = {}
    for module, (a, b) in pairs.items():
        one = _unet_to_kohya("sd15", {f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": b}, alpha)
        names[next(k for k in one if k.endswith(".lora_down.weight")).split(".")[0]] = module
    if family == "sdxl" and all(_sgm_name(k) for k in names):
        names = {_sgm_name(k): m for k, m in names.items()}
    return {k: [m] for k, m in names.items()}


def named_to_kohya(pairs, alpha, prefix="lora_unet"):
    out = {}
    for module, (down, up) in pairs.items():
        name = f"{prefix}_" + module.replace(".", "_")
        out[f"{name}.lora_down.weight"] = down.contiguous()
        out[f"{name}.lora_up.weight"] = up.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


def to_kohya(family: str, peft_state_dict: dict[str, torch.Tensor], rank: int, alpha: float,
             text_encoders: dict[str, dict[str, torch.Tensor]] | None = None, base=None) -> dict[str, torch.Tensor]:
    """`get_peft_model_state_dict(denoiser)` of a `LoraConfig(r=rank, lora_alpha=alpha)` -> kohya state dict.
    `text_encoders`: {pipeline component: its peft state dict} (train.text_encoder_lr, same rank and alpha).
    DoRA (`lora_magnitude_vector` keys): `base(module) -> its frozen weight` gives each module's `dora_scale`."""
    check_family(family)
    peft_state_dict, magnitudes = split_dora(peft_state_dict)
    pairs = lora_pairs(peft_state_dict, rank)  # validates keys and ranks for every family
    if family in ("sdxl", "sd15"):
        out = _unet_to_kohya(family, peft_state_dict, alpha)
    elif family in _NAMED:
        out = named_to_kohya(pairs, alpha)
    else:
        out = _transformer_to_kohya(family, pairs, rank, alpha)
    if magnitudes:
        rows = (_unet_kohya_names(family, pairs, alpha) if family in ("sdxl", "sd15") else
                {"lora_unet_" + m.replace(".", "_"): [m] for m in pairs} if family in _NAMED else
                {"lora_unet_" + k: v for k, v in kohya_rows(family, pairs).items()})
        out.update(dora_scales(out, rows, pairs, magnitudes, alpha / rank, base, family))
    for component, state_dict in (text_encoders or {}).items():
        prefix = _TE_PREFIX.get(family, {}).get(component)
        if prefix is None:
            raise ValueError(f"{family}: no kohya name for a LoRA on {component}")
        out.update(named_to_kohya(lora_pairs(state_dict, rank), alpha, prefix))  # transformers' names, "." -> "_"
    return out


def base_model_version(family: str) -> str:
    """sd-scripts' `ss_base_model_version` of the family (`sdxl_base_v1-0`, `flux1`, ...)."""
    return _META[check_family(family)][1]


def kohya_metadata(family: str, rank: int, alpha: float, **info) -> dict[str, str]:
    """sd-scripts style `ss_*` metadata (safetensors metadata values must be strings)."""
    module, version = _META[check_family(family)]
    meta = {"ss_network_module": module, "ss_base_model_version": version}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list, tuple)) else str(v)
                 for k, v in info.items()})
    # These describe the tensors in the file, so `info` cannot override them.
    meta.update({"ss_network_dim": str(int(rank)), "ss_network_alpha": str(float(alpha))})
    return meta


def save_kohya(path, family, peft_state_dict, rank, alpha, metadata: dict[str, str], text_encoders=None,
               base=None) -> Path:
    """Write `to_kohya(...)` with `metadata` to `path` atomically."""
    return _write(path, to_kohya(family, peft_state_dict, rank, alpha, text_encoders, base), metadata)


def bake_alpha(state_dict: dict[str, torch.Tensor], metadata: dict[str, str]):
    """A diffusers (PEFT-layout) LoRA file's tensors and metadata -> the same LoRA with its scale
    (lora_alpha / r, or / sqrt(r) with rslora) multiplied into every lora_B, and lora_alpha = r, rslora off.
    ComfyUI reads no `lora_adapter_metadata` and applies PEFT keys at scale 1; diffusers reads the metadata
    and now also gets scale 1, so both give the trained delta."""
    adapters = json.loads(metadata[LORA_META])
    out_meta, scale = dict(metadata), {}
    for key in [k for k in adapters if k.endswith(".r")]:
        prefix = key[: -len("r")]
        if adapters.get(prefix + "rank_pattern") or adapters.get(prefix + "alpha_pattern"):
            raise ValueError(f"{prefix}: per-module rank/alpha patterns are not supported")
        r, a = adapters[prefix + "r"], adapters[prefix + "lora_alpha"]
        scale[prefix] = a / (r ** 0.5 if adapters.get(prefix + "use_rslora") else r)
        adapters.update({prefix + "lora_alpha": r, prefix + "use_rslora": False})
        out_meta[f"loraflow_{prefix}trained_alpha"] = str(float(a))
    out = {}
    for k, v in state_dict.items():
        if ".lora_B." in k:
            s = scale[k.split(".", 1)[0] + "."]  # `<component>.` prefix, as diffusers writes it
            v = (v.double() * s).to(v.dtype)
        out[k] = v.contiguous()
    out_meta[LORA_META] = json.dumps(adapters, indent=2, sort_keys=True)
    return out, out_meta


def save_diffusers(path, src) -> Path:
    """The diffusers file `src` with its alpha baked in (`bake_alpha`), written atomically to `path`."""
    with safetensors.safe_open(str(src), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    return _write(path, *bake_alpha(tensors, metadata))


def write_safetensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """`_write` for the LoRA tools (tasks/lora_tools): their files are written the same atomic, canonical way."""
    return _write(path, tensors, metadata)


def _write(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Atomic, canonical write: a crash leaves the old file or the new one, never a truncated file that a UI
    would try to load; the same tensors and metadata give the same bytes."""
    path = Path(path)
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"safetensors metadata must be str -> str: {bad}")
    tensors = {k: v.detach().cpu() for k, v in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # same dir: os.replace must not cross fs
    try:
        st.save_file(tensors, str(tmp), metadata=dict(metadata))
        canonicalize_safetensors(tmp)  # safetensors orders metadata by hash: fix the bytes
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path
