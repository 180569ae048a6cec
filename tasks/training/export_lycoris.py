"""The LyCORIS file of a LoHa/LoKr run (report `artifacts.lora_files.lycoris`, also `.comfyui`).

LyCORIS tensor names with the prefix SimpleTuner's LyCORIS files use, `lycoris_<diffusers module, "." -> "_">`
(`.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`, `.lokr_w1`, `.lokr_w2` or `.lokr_w2_a`/`.lokr_w2_b`,
`.alpha`). ComfyUI's `model_lora_keys_unet` (comfy/lora.py) maps that prefix for Flux and FLUX.2
(`flux_to_diffusers`, q/k/v as slices of the fused qkv), SD3 (`mmdit_to_diffusers`), SDXL/SD1.5
(`unet_to_diffusers`), Qwen-Image and Z-Image (`z_image_to_diffusers`), so one naming serves every family
(tests/test_lycoris.py restates those maps); diffusers' FLUX.2 loader reads it too (LoKr).

Scale: peft multiplies every delta by alpha / r. ComfyUI's LoHa rule is alpha / rank (rank = w1_b's rows), the
same; its LoKr rule is alpha / rank only where w2 (or w1) is factorised and 1 where both are full, so the LoKr
export folds peft's scale into w1 and writes alpha = r: every loader then applies exactly the trained delta.

Pure core: no prefect/hydra imports.
"""
from __future__ import annotations

import json

from tasks.lazy import lazy
from tasks.models.lora_variants.lycoris import network_of, modules_of, read_peft

torch = lazy("torch")


def to_lycoris(state_dict: dict, config: dict) -> dict:
    """peft LoHa/LoKr state dict + config -> LyCORIS tensors (`lycoris_<module>.<suffix>`, `.alpha`)."""
    network = network_of(config)
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("per-module rank/alpha patterns are not supported")
    r, alpha = int(config["r"]), float(config["alpha"])
    out = {}
    for module, parts in modules_of(state_dict, network).items():
        name = "lycoris_" + module.replace(".", "_")
        parts = {k: v.detach().float().contiguous() for k, v in parts.items()}
        if network == "lokr":  # peft's alpha / r folded into w1 (or w1_a); alpha = r gives scale 1 everywhere
            first = "lokr_w1" if "lokr_w1" in parts else "lokr_w1_a"
            parts[first] = parts[first] * (alpha / r)
            parts["alpha"] = torch.tensor(float(r))
        else:
            parts["alpha"] = torch.tensor(alpha)
        out.update({f"{name}.{k}": v for k, v in parts.items()})
    return out


def lycoris_metadata(network: str, rank: int, alpha: float, **info) -> dict[str, str]:
    """kohya-style metadata as LyCORIS writes it (`ss_network_module` lycoris.kohya, the algo in its args)."""
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}
    meta.update({"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps({"algo": network}),
                 "ss_network_dim": str(int(rank)),
                 "ss_network_alpha": str(float(rank if network == "lokr" else alpha))})
    return meta


def save_lycoris(path, src, metadata: dict[str, str]):
    """The exported LyCORIS file of the train node's file `src`, written atomically."""
    from tasks.training.export import write_safetensors

    state_dict, config, _ = read_peft(src)
    network = network_of(config)
    meta = lycoris_metadata(network, int(config["r"]), float(config["alpha"]), **metadata)
    return write_safetensors(path, to_lycoris(state_dict, config), meta)
