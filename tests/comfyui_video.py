"""ComfyUI's model keys for the video families' LoRA targets, and its LoHa/LoKr merge, restated from its code (it
cannot be installed on these machines): what tests/test_video_lycoris.py and tests/test_hunyuan_video15.py check
loraflow's files against. Sources (Comfy-Org/ComfyUI):

- Key map, comfy/lora.py `model_lora_keys_unet` (commit a125cd84b054a57729b5eecab930ca9408719832, lines 179-186;
  the same in 17358c8f73b581a0d22facc3c385822f09b8bfb1): for every `diffusion_model.<k>.weight` of the model,
  `lora_unet_<k, "." -> "_">` (and `<k>` bare). No `lycoris_` name for WAN21/WAN22, LTXV/LTXAV or HunyuanVideo
  (only unet_to_diffusers, SD3, Flux, Qwen-Image, Z-Image and a few others register one), so a video model's
  LyCORIS file must use the generic name.
- comfy/lora.py `load_lora` (lines 53-57): each mapped name x is offered to every weight adapter; keys no adapter
  reads are logged "lora key not loaded".
- comfy/weight_adapter/loha.py `calculate_weight` (line 184 on): (w1a @ w1b) * (w2a @ w2b) * alpha / w1b.shape[0];
  lokr.py `calculate_weight` (line 163 on): kron(w1, w2) with w = a @ b where factorised, times alpha / dim (dim
  = w1_b's rows, then w2_b's where w2 is factorised; 1 where both are full), reshaped to the weight's shape.
- The models' keys: WAN21 (comfy/ldm/wan/model.py: blocks.N.self_attn / cross_attn .q .k .v .o, lines 52-55,
  ffn.0 / ffn.2, lines 204-205; WAN22 subclasses it), named from diffusers' side by diffusers'
  `_convert_non_diffusers_wan_lora_to_diffusers` (self_attn -> attn1, cross_attn -> attn2, q/k/v/o ->
  to_q/to_k/to_v/to_out.0, ffn.0 -> ffn.net.0.proj, ffn.2 -> ffn.net.2); LTXV (comfy/ldm/lightricks/model.py:
  transformer_blocks.N.attn1 / attn2 .to_q .to_k .to_v .to_out.0, lines 268-272, ff.net.0.proj / ff.net.2,
  lines 216-233: diffusers' names); HunyuanVideo 1.5 (`_HV15` below)."""
from __future__ import annotations

import re

import torch

# ComfyUI's HunyuanVideo model (comfy/ldm/hunyuan_video/model.py, the HunyuanVideo 1.5 version as quoted in this
# workplace's code index, file 52160474187: `double_blocks` of comfy.ldm.flux.layers.DoubleStreamBlock, beside the
# 1.5 modules byt5_in / vision_in / cond_type_embedding) and Flux's DoubleStreamBlock (comfy/ldm/flux/layers.py at
# a125cd84, lines 82-155): img_mod.lin, img_attn.qkv (q | k | v rows, as its forward's view(..., 3, heads, -1)
# splits them), img_attn.proj, img_mlp.0 / img_mlp.2, and the same for txt_. diffusers' names for the same Linears:
# scripts/convert_hunyuan_video1_5_to_diffusers.py (diffusers commit 38c42b4de1b98bee31cb35d98aa0bf3398a960cb),
# which maps the original img_attn_q/k/v, img_attn_proj, img_mlp.fc1/fc2, img_mod.linear (txt_ likewise) one to
# one onto attn.to_q/k/v, to_out.0, ff.net.0.proj/ff.net.2, norm1.linear. {diffusers: (ComfyUI module, slot)}
HV15 = {"attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
        "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
        "attn.add_v_proj": ("txt_attn.qkv", 2), "attn.to_out.0": ("img_attn.proj", 0),
        "attn.to_add_out": ("txt_attn.proj", 0), "ff.net.0.proj": ("img_mlp.0", 0), "ff.net.2": ("img_mlp.2", 0),
        "ff_context.net.0.proj": ("txt_mlp.0", 0), "ff_context.net.2": ("txt_mlp.2", 0),
        "norm1.linear": ("img_mod.lin", 0), "norm1_context.linear": ("txt_mod.lin", 0)}
# Wan 2.1 I2V's image key/value Linears: comfy/ldm/wan/model.py WanI2VCrossAttention k_img / v_img (diffusers'
# attn2.add_k_proj / add_v_proj, by the same converter)
_WAN = {"attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o",
        "add_k_proj": "k_img", "add_v_proj": "v_img", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
_WAN_RE = r"blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0|add_[kv]_proj)|ffn\.net\.(0\.proj|2))"
_WANS = ("wan", "wan22", "wan_i2v", "wan22_i2v", "wan22_ti2v")  # one ComfyUI model class (WAN21 and its subclasses)
_LTX_RE = r"transformer_blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ff\.net\.(0\.proj|2))"


def comfy_keys(family: str, den: torch.nn.Module) -> tuple[dict, dict]:
    """({ComfyUI module key: (out, in)}, {diffusers Linear: (ComfyUI module key, its rows)}) for the block Linears
    of `den` (before peft wraps them) that ComfyUI's model of the family has."""
    keys, rows = {}, {}
    for n, m in den.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        if family in _WANS and re.fullmatch(_WAN_RE, n):
            key, slot = n, 0
            for d, o in _WAN.items():
                key = key.replace(f".{d}", f".{o}")
        elif family == "ltx2" and re.fullmatch(_LTX_RE, n):
            key, slot = n, 0
        elif family.startswith("hunyuan_video15") and (hit := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", n)) \
                and hit[2] in HV15:
            name, slot = HV15[hit[2]]
            key = f"double_blocks.{hit[1]}.{name}"
        else:
            continue
        out, _ = keys.get(key, (0, m.in_features))
        rows[n] = (key, slice(slot * m.out_features, (slot + 1) * m.out_features))
        keys[key] = (out + m.out_features, m.in_features)
    return keys, rows


def lycoris_merge(file: dict[str, torch.Tensor], keys: dict) -> dict[str, torch.Tensor]:
    """{ComfyUI module key: its merged delta} (float64), as load_lora and the LoHa/LoKr adapters compute them
    through the generic `lora_unet_` names; fails on any file key left unread and on a delta of another shape."""
    key_map = {"lora_unet_" + k.replace(".", "_"): k for k in keys}
    read, out = set(), {}
    for x, key in key_map.items():
        v = {s: file[f"{x}.{s}"].double() for s in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1",
             "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha") if f"{x}.{s}" in file}
        if not v.keys() - {"alpha"}:
            continue
        read |= {f"{x}.{s}" for s in v}
        alpha = v["alpha"].item() if "alpha" in v else None
        if "hada_w1_a" in v:
            scale = alpha / v["hada_w1_b"].shape[0] if alpha is not None else 1.0
            delta = (v["hada_w1_a"] @ v["hada_w1_b"]) * (v["hada_w2_a"] @ v["hada_w2_b"]) * scale
        else:
            dim = None
            w1 = v.get("lokr_w1")
            if w1 is None:
                dim, w1 = v["lokr_w1_b"].shape[0], v["lokr_w1_a"] @ v["lokr_w1_b"]
            w2 = v.get("lokr_w2")
            if w2 is None:
                dim, w2 = v["lokr_w2_b"].shape[0], v["lokr_w2_a"] @ v["lokr_w2_b"]
            delta = torch.kron(w1, w2) * (alpha / dim if alpha is not None and dim is not None else 1.0)
        assert tuple(delta.shape) == keys[key], (x, tuple(delta.shape), keys[key])
        out[key] = delta
    left = sorted(set(file) - read)
    assert not left, f"ComfyUI would log 'lora key not loaded' for {len(left)} key(s), e.g. {left[:4]}"
    return out
