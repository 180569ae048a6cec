"""A trained-looking PEFT LoRA on a denoiser: peft starts lora_B at zero, so B is drawn here (seeded, x 0.1),
as the key-map, export and LoRA-tool tests need a non-zero delta; and the tiny models and targets those tests
share (tests/conftest.py's model_dirs fixture builds each model once per module)."""
from __future__ import annotations

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from tasks.models.flux2_dev import Flux2DevAdapter
from tasks.models.flux2_klein import Flux2KleinAdapter
from tasks.models.tiny.tiny_flux import build_tiny_flux, build_tiny_flux_kontext
from tasks.models.tiny.tiny_flux2 import build_tiny_flux2
from tasks.models.tiny.tiny_flux2_dev import build_tiny_flux2_dev
from tasks.models.tiny.tiny_qwenimage import build_tiny_qwenimage
from tasks.models.tiny.tiny_sd3 import build_tiny_sd3
from tasks.models.tiny.tiny_unet import build_tiny_sd15, build_tiny_sdxl
from tasks.models.tiny.tiny_zimage import build_tiny_zimage
from tasks.models.zimage import ZImageAdapter


def random_lora(den: torch.nn.Module, targets, rank: int, alpha: float, seed: int = 1) -> tuple[dict, LoraConfig]:
    """Adds the adapter to `den` and returns (its PEFT state dict, its config)."""
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets)
    den.add_adapter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in den.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return get_peft_model_state_dict(den), config


def factors_and_deltas(sd: dict, rank: int, alpha: float, prefix: str = "transformer") -> tuple[dict, dict]:
    """({prefix.module: (A, B, alpha / rank)}, {prefix.module: float64 delta}) of a PEFT state dict."""
    factors = {f"{prefix}.{k[: -len('.lora_A.weight')]}": (v, sd[k.replace("lora_A", "lora_B")], alpha / rank)
               for k, v in sd.items() if k.endswith(".lora_A.weight")}
    return factors, {m: s * (b.double() @ a.double()) for m, (a, b, s) in factors.items()}


# The tiny models LoRA files are checked on (tests/conftest.py's model_dirs builds each once per module),
# and the modules the hand-made LoRAs target: every kohya name rule of each family exercised
BUILDERS = {"flux": build_tiny_flux, "flux_kontext": build_tiny_flux_kontext, "sd3": build_tiny_sd3, "sdxl": build_tiny_sdxl, "sd15": build_tiny_sd15,
            "zimage": build_tiny_zimage, "qwenimage": build_tiny_qwenimage, "flux2_klein": build_tiny_flux2,
            "flux2_dev": build_tiny_flux2_dev}
_ATTN = ["to_k", "to_q", "to_v", "to_out.0"]
_JOINT = _ATTN + ["add_k_proj", "add_q_proj", "add_v_proj", "to_add_out"]
TARGETS = {
    # Flux: attention of both block types (single blocks have attn.to_q/k/v), plus MLPs and the final proj_out.
    "flux": _JOINT + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"],
    "sd3": [f"attn.{m}" for m in _JOINT],
    "sdxl": _ATTN,
    "sd15": _ATTN,
    "zimage": ZImageAdapter.LORA_TARGETS,  # main layers and both refiners: attention and feed-forward
    # both streams' attention and MLPs (more than the default targets, so every name rule is exercised)
    "qwenimage": ["to_k", "to_q", "to_v", "to_out.0", "add_k_proj", "add_q_proj", "add_v_proj", "to_add_out",
     "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"],
    "flux2_klein": Flux2KleinAdapter.LORA_TARGETS,  # every block projection: all kohya name rules
    "flux2_dev": Flux2DevAdapter.LORA_TARGETS,  # the same blocks (tasks/models/bases/flux2.py), a guidance embedding more
}

# Original-checkpoint Linear (kohya name without `lora_unet_`) -> the diffusers Linears that are its row blocks,
# as in ComfyUI's flux_to_diffusers / diffusers' SD3 single-file converter. Written out for block 0 (the tiny
# models have one block of each kind).
_T, _S = "transformer_blocks.0.", "single_transformer_blocks.0."
MERGE_TABLE = {
    "flux": {
        "double_blocks_0_img_attn_qkv": [_T + "attn.to_q", _T + "attn.to_k", _T + "attn.to_v"],
        "double_blocks_0_txt_attn_qkv": [_T + "attn.add_q_proj", _T + "attn.add_k_proj", _T + "attn.add_v_proj"],
        "double_blocks_0_img_attn_proj": [_T + "attn.to_out.0"],
        "double_blocks_0_txt_attn_proj": [_T + "attn.to_add_out"],
        "double_blocks_0_img_mlp_0": [_T + "ff.net.0.proj"],
        "double_blocks_0_img_mlp_2": [_T + "ff.net.2"],
        "double_blocks_0_txt_mlp_0": [_T + "ff_context.net.0.proj"],
        "double_blocks_0_txt_mlp_2": [_T + "ff_context.net.2"],
        "single_blocks_0_linear1": [_S + "attn.to_q", _S + "attn.to_k", _S + "attn.to_v", _S + "proj_mlp"],
        "single_blocks_0_linear2": [_S + "proj_out"],
    },
    "sd3": {
        "joint_blocks_0_x_block_attn_qkv": [_T + "attn.to_q", _T + "attn.to_k", _T + "attn.to_v"],
        "joint_blocks_0_context_block_attn_qkv": [_T + "attn.add_q_proj", _T + "attn.add_k_proj",
                                                  _T + "attn.add_v_proj"],
        "joint_blocks_0_x_block_attn_proj": [_T + "attn.to_out.0"],
        "joint_blocks_0_context_block_attn_proj": [_T + "attn.to_add_out"],
    },
}
