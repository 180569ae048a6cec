"""The LoRA in ComfyUI's own layout (report `artifacts.lora_files.comfyui`): for Z-Image, whose ComfyUI model fuses
q/k/v, a file apart; for every other family the kohya file of tasks/training/export.py is it. Pure core."""
from __future__ import annotations

import re
from pathlib import Path

from tasks.lazy import lazy
from tasks.training.dora_export import dora_scales, split_dora
from tasks.training.export import kohya_rows, layout, lora_pairs, named_to_kohya, to_kohya, write_safetensors

torch = lazy("torch")

# ComfyUI's Z-Image model (comfy/ldm/lumina NextDiT, as Comfy-Org's z_image_convert_original_to_comfy.py and
# comfy/utils.py's z_image_to_diffusers name it) fuses q/k/v into `attention.qkv` and calls to_out.0 `attention.out`;
# its LoRA keys are `lora_unet_<model key>` (comfy/lora.py model_lora_keys_unet). Other renamed modules are
# never LoRA targets (tasks/models/zimage.py LORA_TARGETS).
_COMFY_ZIMAGE_QKV = re.compile(r"(.+\.attention)\.to_([qkv])")


def comfyui_loads_kohya(family: str) -> bool:
    """Whether ComfyUI's own loader maps every key of this family's kohya file (then that file is the ComfyUI
    file): all but Z-Image, whose kohya file names diffusers' unfused q/k/v (docs/lora-files.md)."""
    return not layout(family).comfyui_fuses_qkv


def to_comfyui(family: str, peft_state_dict: dict[str, torch.Tensor], rank: int, alpha: float,
               base=None) -> dict[str, torch.Tensor]:
    """The LoRA in the names and layout ComfyUI's own model has. Z-Image: each block's q/k/v LoRAs fused exactly
    into one `attention.qkv` LoRA of rank 3 * rank (down weights stacked, up weights block-diagonal with each
    alpha / rank folded into its block, alpha = the fused rank), so ComfyUI's W_qkv += up @ down is the three
    deltas stacked; to_out.0 -> `attention.out`. Other families: their kohya layout."""
    if not layout(family).comfyui_fuses_qkv:
        return to_kohya(family, peft_state_dict, rank, alpha, base=base)
    peft_state_dict, magnitudes = split_dora(peft_state_dict)
    pairs, fused, out = lora_pairs(peft_state_dict, rank), {}, {}
    for module, (down, up) in pairs.items():
        if m := _COMFY_ZIMAGE_QKV.fullmatch(module):
            fused.setdefault(m.group(1) + ".qkv", {})["qkv".index(m.group(2))] = (down, up)
        else:
            out.update(named_to_kohya({module.replace(".to_out.0", ".out"): (down, up)}, alpha))
    scale = alpha / rank
    for module, slots in fused.items():
        # a slot that was not trained (train.target_modules) adds nothing: zero rows of q's width (Z-Image's
        # q, k and v have the same width: n_kv_heads == n_heads)
        down0, up0 = next(iter(slots.values()))
        parts = [slots.get(i, (torch.zeros_like(down0), torch.zeros_like(up0))) for i in range(3)]
        down = torch.cat([d for d, _ in parts])
        up = torch.block_diag(*[(u.double() * scale).to(u.dtype) for _, u in parts])
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.lora_down.weight"] = down.contiguous()
        out[f"{name}.lora_up.weight"] = up.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(down.shape[0]))
    if magnitudes:  # the deltas ComfyUI merges are the trained ones (fused: alpha/rank folded into up)
        rows = {"lora_unet_" + k: v for k, v in comfyui_rows(family, pairs).items()}
        out.update(dora_scales(out, rows, pairs, magnitudes, alpha / rank, base, family))
    return out


def comfyui_rows(family: str, module_names) -> dict[str, list[str]]:
    """The ComfyUI file's module (without `lora_unet_`) -> the diffusers Linears of `module_names` that are its
    row blocks, in order: `to_comfyui` read backwards, for a loader merging that file onto a diffusers model."""
    if not layout(family).comfyui_fuses_qkv:
        return kohya_rows(family, module_names)
    rows: dict[str, dict[int, str]] = {}
    for module in module_names:
        m = _COMFY_ZIMAGE_QKV.fullmatch(module)
        name = (m.group(1) + ".qkv" if m else module.replace(".to_out.0", ".out")).replace(".", "_")
        rows.setdefault(name, {})["qkv".index(m.group(2)) if m else 0] = module
    return {name: [slots[i] for i in sorted(slots)] for name, slots in rows.items()}


def save_comfyui(path, family, peft_state_dict, rank, alpha, metadata: dict[str, str], base=None) -> Path:
    """Write `to_comfyui(...)` with `metadata` to `path` atomically."""
    return write_safetensors(path, to_comfyui(family, peft_state_dict, rank, alpha, base), metadata)
