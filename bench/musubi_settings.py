"""bench.musubi_side's shared ground: the architectures, the LoRA modules and musubi-tuner's command line both
trainers use, the settings (`Setting`: bf16, fp8, fp8scaled, dequant, swapN, h2d, pinned) and one batch's inputs
in each trainer's form. Where musubi-tuner's source is (bench/musubi_source.sh) and at which commit."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from bench.flux_train import FLUX_DEV


HERE = Path(__file__).resolve().parent


MUSUBI_SRC = HERE / "third_party" / "musubi_tuner" / "src"  # bench/musubi_source.sh writes it


MUSUBI_COMMIT = "30c658c4f4b0bf05038b3346eff9670259b10fc7"  # bench/musubi_source.sh


GIB = 1 << 30


RANK = 16


LR = 1e-4


# Qwen-Image's DiT: musubi's create_model = diffusers' transformer/config.json
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))


QWEN_TINY = dict(QWEN_IMAGE, num_layers=3, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                 axes_dims_rope=(4, 6, 6))


# FLUX.1 Kontext [dev]: FLUX.1-dev's transformer (musubi's configs_flux_dev_context); tiny: enough single blocks for
# musubi's swap (it swaps 2(N - N//2) + 1 single blocks and keeps 2)
KONTEXT_TINY = dict(FLUX_DEV, num_layers=2, num_single_layers=5, attention_head_dim=16, num_attention_heads=2,
                    joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


# musubi's default LoRA modules, as peft targets on diffusers' models (see the docstring)
QWEN_TARGETS = ("img_mod.1", "txt_mod.1", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj",
                "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj",
                "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")


KONTEXT_TARGETS = (r"(transformer_blocks|single_transformer_blocks)\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj"
                   r"|add_v_proj|to_out\.0|to_add_out)|ff(_context)?\.net\.(0\.proj|2)|proj_mlp|proj_out)")


# musubi's command line (its docs' recipe; rank, alpha, lr and optimizer as loraflow's side)
MUSUBI_FLAGS = ["--dit", "random-weights", "--dataset_config", "none", "--sdpa", "--mixed_precision", "bf16",
                "--weighting_scheme", "none", "--optimizer_type", "adamw", "--learning_rate", str(LR),
                "--gradient_checkpointing", "--network_dim", str(RANK), "--network_alpha", str(RANK),
                "--max_grad_norm", "1.0", "--seed", "42"]


FAMILY_FLAGS = {"qwenimage": ["--timestep_sampling", "shift", "--discrete_flow_shift", "2.2",
                              "--network_module", "networks.lora_qwen_image"],
                "flux_kontext": ["--timestep_sampling", "flux_shift", "--network_module", "networks.lora_flux"]}


class MusubiMissing(RuntimeError):
    pass


# -- settings ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Setting:
    name: str
    fp8: bool = False
    scaled: bool = False
    dequant: bool = False
    swap: int = 0
    h2d: bool = False
    pinned: bool = False

    @classmethod
    def parse(cls, name: str) -> "Setting":
        parts = name.split("+")
        swaps = [int(p[4:]) for p in parts if p.startswith("swap") and p[4:].isdigit()]
        unknown = [p for p in parts if p not in ("bf16", "fp8", "fp8scaled", "dequant", "h2d", "pinned")
                   and not (p.startswith("swap") and p[4:].isdigit())]
        if unknown:
            raise ValueError(f"setting {name!r}: unknown {unknown} (parts: bf16, fp8, fp8scaled, dequant, swapN, h2d, "
                             "pinned, joined by +)")
        return cls(name, fp8="fp8" in parts or "fp8scaled" in parts, scaled="fp8scaled" in parts,
                   dequant="dequant" in parts, swap=swaps[0] if swaps else 0, h2d="h2d" in parts,
                   pinned="pinned" in parts)

    def musubi_flags(self, swap: int) -> list[str]:
        return ((["--fp8_base"] if self.fp8 else []) + (["--fp8_scaled"] if self.scaled else [])
                + (["--blocks_to_swap", str(swap)] if swap else []) + (["--block_swap_h2d_only"] if self.h2d else [])
                + (["--use_pinned_memory_for_block_swap"] if self.pinned else []))

    def loraflow_overrides(self, swap: int) -> dict:
        model = {"quantize": "fp8", "matmul": "dequantize" if self.dequant else "auto"} if self.fp8 else {}
        return {"model": model, "train": {"blocks_to_swap": swap} if swap else {}}


# -- the two families --------------------------------------------------------------------------------------------
def max_swap(family: str, arch: dict) -> int:
    """The most blocks each trainer can swap in this architecture (musubi's enable_block_swap asserts)."""
    if family == "qwenimage":
        return arch["num_layers"] - 1
    n = 0
    while (n + 1) // 2 <= arch["num_layers"] - 2 and ((n + 1) - (n + 1) // 2) * 2 + 1 <= arch["num_single_layers"] - 2:
        n += 1
    return n


def make_inputs(family: str, arch: dict, resolution: int, text_len: int, device) -> dict:
    """One batch's cached tensors (random, seeded), shared by both trainers."""
    import torch

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    latent = resolution // 8
    channels = 16  # the VAE's; both DiTs take 2x2 patches of them (in_channels 64)
    data = {"latents": rnd(1, channels, latent, latent), "text": rnd(1, text_len, arch["joint_attention_dim"])}
    if family == "flux_kontext":
        data.update(control=rnd(1, channels, latent, latent), pooled=rnd(1, arch["pooled_projection_dim"]))
    return data


def musubi_batch(family: str, data: dict) -> dict:
    """The batch musubi's dataloader hands a step (its cached latents and text encoder outputs): new tensors each
    step, as from its dataloader (call_dit sets requires_grad on some of them in place)."""
    data = {k: v.clone() for k, v in data.items()}
    if family == "qwenimage":  # latents B, C, 1, H, W; vl_embed: a list of each item's (L, D), no padding
        return {"latents": data["latents"][:, :, None], "vl_embed": [data["text"][0]], "timesteps": None}
    return {"latents": data["latents"], "latents_control": data["control"], "t5_vec": data["text"],
            "clip_l_pooler": data["pooled"], "timesteps": None}


def loraflow_inputs(family: str, data: dict):
    """(latents, text) as loraflow's train node reads them from its store."""
    import torch

    if family == "qwenimage":
        mask = torch.ones(data["text"].shape[:2], dtype=torch.int64, device=data["text"].device)
        return data["latents"], {"prompt_embeds": data["text"], "attention_mask": mask}
    return data["latents"], {"prompt_embeds": data["text"], "pooled_prompt_embeds": data["pooled"],
                             "control_latents": data["control"][:, None]}
