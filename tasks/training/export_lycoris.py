"""The LyCORIS file of a LoHa/LoKr run (report `artifacts.lora_files.lycoris`, also `.comfyui`).

LyCORIS tensor names with the prefix SimpleTuner's LyCORIS files use, `lycoris_<diffusers module, "." -> "_">`
(`.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`, `.lokr_w1`, `.lokr_w2` or `.lokr_w2_a`/`.lokr_w2_b`,
`.alpha`). ComfyUI's `model_lora_keys_unet` (comfy/lora.py) maps that prefix for Flux and FLUX.2
(`flux_to_diffusers`, q/k/v as slices of the fused qkv), SD3 (`mmdit_to_diffusers`), SDXL/SD1.5
(`unet_to_diffusers`), Qwen-Image and Z-Image (`z_image_to_diffusers`), so one naming serves every family
(tests/test_lycoris.py restates those maps); diffusers' FLUX.2 loader reads it too (LoKr).

ComfyUI maps no `lycoris_` name for its video models (Wan, LTX-2, HunyuanVideo 1.5): only its generic
`lora_unet_<model key>`. A family declaring `lycoris_names="comfyui"` (its KohyaLayout) gets its ComfyUI file's
module names instead (`lora_unet_blocks_0_self_attn_q`, as LyCORIS's lycoris.kohya names a module), a fused
module's row blocks fused exactly (tasks/training/lycoris_fused.py); the metadata `loraflow_lycoris_rows` names
each module's diffusers Linears, one per row block, for loraflow's own loader (lycoris.apply_lycoris).

Scale: peft multiplies every delta by alpha / r. ComfyUI's LoHa rule is alpha / rank (rank = w1_b's rows), the
same; its LoKr rule is alpha / rank only where w2 (or w1) is factorised and 1 where both are full, so the LoKr
export folds peft's scale into w1 and writes alpha = r: every loader then applies exactly the trained delta.

Pure core: no prefect/hydra imports.
"""
from __future__ import annotations

import json

from tasks.lazy import lazy
from tasks.models.lora_variants.lycoris import ROWS_META, network_of, modules_of, read_peft
from tasks.training.lycoris_fused import fuse

torch = lazy("torch")


def to_lycoris(state_dict: dict, config: dict, family: str | None = None) -> dict:
    """peft LoHa/LoKr state dict + config -> LyCORIS tensors (`<module>.<suffix>`, `.alpha`): `lycoris_<diffusers
    module>`, or the family's ComfyUI names where it declares them (module docstring)."""
    network = network_of(config)
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("per-module rank/alpha patterns are not supported")
    r, alpha = int(config["r"]), float(config["alpha"])
    modules = {}
    for module, parts in modules_of(state_dict, network).items():
        parts = {k: v.detach().float().contiguous() for k, v in parts.items()}
        if network == "lokr":  # peft's alpha / r folded into w1 (or w1_a); alpha = r gives scale 1 everywhere
            first = "lokr_w1" if "lokr_w1" in parts else "lokr_w1_a"
            parts[first] = parts[first] * (alpha / r)
            parts["alpha"] = torch.tensor(float(r))
        else:
            parts["alpha"] = torch.tensor(alpha)
        modules[module] = parts
    rows = lycoris_rows(family, modules)
    out = {}
    for name, slots in (rows or {"lycoris_" + m.replace(".", "_"): [m] for m in modules}).items():
        if len(slots) == 1:
            parts = modules[slots[0]]
        else:
            parts = fuse(network, name, [modules[m] if m else None for m in slots])
        out.update({f"{name}.{k}": v.contiguous() for k, v in parts.items()})
    return out


def lycoris_rows(family: str | None, modules, strict: bool = True) -> dict[str, list[str | None]] | None:
    """`lora_unet_<ComfyUI module>` -> its row blocks' diffusers modules (None: a slot not trained), for a family
    whose LyCORIS file has ComfyUI's names; None: `lycoris_<diffusers module>`, one each."""
    from tasks.training.export import layout

    if family is None or layout(family).lycoris_names == "diffusers":
        return None
    from tasks.training.export_comfyui import comfyui_slots

    return {"lora_unet_" + k: v for k, v in comfyui_slots(family, modules, strict).items()}


def fused_groups(family: str, modules) -> list[list[str]]:
    """The trained modules that are row blocks of one module of the family's LyCORIS file (HunyuanVideo 1.5's
    q, k, v): what a LoKr must share w2 across (tasks/training/lycoris_fused.py)."""
    rows = lycoris_rows(family, modules, strict=False) or {}
    return [[m for m in slots if m] for slots in rows.values() if len([m for m in slots if m]) > 1]


def lycoris_metadata(network: str, rank: int, alpha: float, **info) -> dict[str, str]:
    """kohya-style metadata as LyCORIS writes it (`ss_network_module` lycoris.kohya, the algo in its args)."""
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}
    meta.update({"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps({"algo": network}),
                 "ss_network_dim": str(int(rank)),
                 "ss_network_alpha": str(float(rank if network == "lokr" else alpha))})
    return meta


def save_lycoris(path, src, metadata: dict[str, str], family: str | None = None):
    """The exported LyCORIS file of the train node's file `src` (in `family`'s names), written atomically."""
    from tasks.training.export import write_safetensors

    state_dict, config, _ = read_peft(src)
    network = network_of(config)
    meta = lycoris_metadata(network, int(config["r"]), float(config["alpha"]), **metadata)
    rows = lycoris_rows(family, modules_of(state_dict, network))
    if rows:  # loraflow's own loader reads which diffusers Linears each module's rows are
        meta[ROWS_META] = json.dumps(rows, sort_keys=True)
    return write_safetensors(path, to_lycoris(state_dict, config, family), meta)
