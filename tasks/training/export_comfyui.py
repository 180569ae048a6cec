"""The LoRA in ComfyUI's own layout (report `artifacts.lora_files.comfyui`): for Z-Image and HunyuanVideo 1.5, whose
ComfyUI models fuse q/k/v where their kohya files (diffusers' / musubi-tuner's names) do not, a file apart; for every
other family the kohya file of tasks/training/export.py is it. Pure core."""
from __future__ import annotations

import re
from pathlib import Path

from tasks.lazy import lazy
from tasks.training.dora_export import dora_scales, split_dora
from tasks.training.export import (RULE_SLOTS, kohya_rows, layout, lora_pairs, named_to_kohya, to_kohya,
                                   transformer_to_kohya, write_safetensors)

torch = lazy("torch")

# ComfyUI's Z-Image model (comfy/ldm/lumina NextDiT, as Comfy-Org's z_image_convert_original_to_comfy.py and
# comfy/utils.py's z_image_to_diffusers name it) fuses q/k/v into `attention.qkv` and calls to_out.0 `attention.out`;
# its LoRA keys are `lora_unet_<model key>` (comfy/lora.py model_lora_keys_unet). Other renamed modules are
# never LoRA targets (tasks/models/zimage.py LORA_TARGETS).
_COMFY_ZIMAGE_QKV = re.compile(r"(.+\.attention)\.to_([qkv])")


def comfyui_loads_kohya(family: str) -> bool:
    """Whether ComfyUI's own loader maps every key of this family's kohya file (then that file is the ComfyUI
    file): all but Z-Image and HunyuanVideo 1.5, whose kohya files name unfused q/k/v (docs/lora-files.md)."""
    return not (layout(family).comfyui_fuses_qkv or layout(family).comfyui_rules)


def to_comfyui(family: str, peft_state_dict: dict[str, torch.Tensor], rank: int, alpha: float,
               base=None) -> dict[str, torch.Tensor]:
    """The LoRA in the names and layout ComfyUI's own model has. Z-Image: each block's q/k/v LoRAs fused exactly
    into one `attention.qkv` LoRA of rank 3 * rank (down weights stacked, up weights block-diagonal with each
    alpha / rank folded into its block, alpha = the fused rank), so ComfyUI's W_qkv += up @ down is the three
    deltas stacked; to_out.0 -> `attention.out`. A family with `comfyui_rules` (HunyuanVideo 1.5): those rules,
    fused as the kohya file's are. Other families: their kohya layout."""
    if rules := layout(family).comfyui_rules:
        peft_state_dict, magnitudes = split_dora(peft_state_dict)
        pairs = lora_pairs(peft_state_dict, rank)
        out = transformer_to_kohya(family, pairs, rank, alpha, rules)
        if magnitudes:
            rows = {"lora_unet_" + k: v for k, v in comfyui_rows(family, pairs).items()}
            out.update(dora_scales(out, rows, pairs, magnitudes, alpha / rank, base, family))
        return out
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
        return kohya_rows(family, module_names, layout(family).comfyui_rules or None)
    rows: dict[str, dict[int, str]] = {}
    for module in module_names:
        m = _COMFY_ZIMAGE_QKV.fullmatch(module)
        name = (m.group(1) + ".qkv" if m else module.replace(".to_out.0", ".out")).replace(".", "_")
        rows.setdefault(name, {})["qkv".index(m.group(2)) if m else 0] = module
    return {name: [slots[i] for i in sorted(slots)] for name, slots in rows.items()}


def comfyui_slots(family: str, module_names, strict: bool = True) -> dict[str, list[str | None]]:
    """The ComfyUI file's module (without `lora_unet_`) -> its row blocks' diffusers Linears, one per slot of the
    fused Linear (None: a slot not among `module_names`), for the families whose ComfyUI names are rules or
    diffusers' ("named"): what the LyCORIS file in ComfyUI's names fuses (tasks/training/export_lycoris.py).
    A module with no ComfyUI name is an error, or left out (`strict=False`)."""
    lay = layout(family)
    rules = lay.comfyui_rules or (lay.rules if lay.names == "rules" else ())
    if not rules and lay.names != "named" or lay.comfyui_fuses_qkv:
        raise ValueError(f"{family}: no ComfyUI names by rule for a LyCORIS file (its lycoris_names: diffusers)")
    out: dict[str, list[str | None]] = {}
    for module in module_names:
        if not rules:
            out[module.replace(".", "_")] = [module]
            continue
        for pattern, name, size in rules:
            if m := re.fullmatch(pattern, module):
                slots = out.setdefault(name.format(*m.groups()[:1]), [None] * size)
                slots[RULE_SLOTS[m.group(2)] if size > 1 else 0] = module
                break
        else:
            if strict:
                raise ValueError(f"{family}: no ComfyUI name for LoRA module {module!r}")
    return out


def save_comfyui(path, family, peft_state_dict, rank, alpha, metadata: dict[str, str], base=None) -> Path:
    """Write `to_comfyui(...)` with `metadata` to `path` atomically."""
    return write_safetensors(path, to_comfyui(family, peft_state_dict, rank, alpha, base), metadata)
