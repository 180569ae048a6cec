"""diffusers transformer state dict -> the family's released single-file layout, for `merge --into-base --layout
original` (ldm.py does SD1.5 / SDXL's UNet):

- qwenimage: the same keys. Qwen-Image's single files (ComfyUI's diffusion_models/) use diffusers' names, and
  diffusers' `QwenImageTransformer2DModel.from_single_file` maps them unchanged (single_file_model.py).
- zimage: ComfyUI's / Tongyi's names, the reverse of diffusers' `convert_z_image_transformer_checkpoint_to_diffusers`
  (single_file_utils.py): each block's to_q / to_k / to_v stacked into one `attention.qkv.weight`, `to_out.0` as
  `attention.out`, `norm_q` / `norm_k` as `q_norm` / `k_norm`, `all_x_embedder.2-1` / `all_final_layer.2-1` as
  `x_embedder` / `final_layer`. Every tensor maps to exactly one key.

Not written: Flux, FLUX.2, SD3 (their BFL / SAI layouts; use --layout diffusers, which ComfyUI also loads).
Tests: tests/test_lora_tools.py reads each file back with diffusers' own from_single_file."""
from __future__ import annotations

import re

from tasks.lazy import lazy

torch = lazy("torch")

_ZIMAGE_RENAMES = ((".attention.to_out.0.", ".attention.out."), (".attention.norm_q.", ".attention.q_norm."),
                   (".attention.norm_k.", ".attention.k_norm."), ("all_x_embedder.2-1.", "x_embedder."),
                   ("all_final_layer.2-1.", "final_layer."))
_QKV = re.compile(r"(.+\.attention)\.to_([qkv])\.weight")


def to_original(family: str, sd: dict) -> dict:
    if family == "qwenimage":
        return dict(sd)
    if family != "zimage":
        raise NotImplementedError(family)
    out, qkv = {}, {}
    for key, tensor in sd.items():
        if m := _QKV.fullmatch(key):
            qkv.setdefault(m.group(1), {})[m.group(2)] = tensor
            continue
        for old, new in _ZIMAGE_RENAMES:
            key = key.replace(old, new)
        out[key] = tensor
    for block, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"{block}: to_q, to_k and to_v are fused in the original layout; found {sorted(parts)}")
        out[f"{block}.qkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out
