"""Test helper: diffusers pipeline folder -> original-layout (LDM / SGM) single-file state dict.

The UNet part lives in tasks/lora_tools/ldm.py (`merge --into-base --layout original` writes it). The reverse
of diffusers' `loaders/single_file_utils.py` converters (convert_ldm_unet_checkpoint,
convert_ldm_vae_checkpoint, convert_ldm_clip_checkpoint, convert_open_clip_checkpoint), so tests can
make the kind of file civitai / A1111 users have (`model.diffusion_model.*`, `first_stage_model.*`,
`cond_stage_model.transformer.text_model.*`, SDXL `conditioner.embedders.{0,1}.*`) from a tiny
diffusers folder. Modelled on diffusers' scripts/convert_diffusers_to_original_stable_diffusion.py and
convert_diffusers_to_original_sdxl.py, but the block index arithmetic is read from the folder's
configs instead of being hard-coded to layers_per_block=2 and 4 levels.

Every diffusers tensor maps to exactly one original key (the CLIP-G q/k/v triples to one
in_proj), and the functions raise if any tensor is left over, so a round trip through
`from_single_file(file, config=folder)` can be checked for exact equality.

    from safetensors.torch import save_file
    save_file(to_ldm_sd15(folder), "model.safetensors")
    StableDiffusionPipeline.from_single_file("model.safetensors", config=str(folder))

Caveat for SDXL: diffusers picks the CLIP-L (`conditioner.embedders.0`) weights for ANY CLIP text
model whose hidden size equals CLIP-L's (it compares position-embedding widths), so text_encoder_2
must be wider than text_encoder, as in the real model (768 vs 1280); `to_ldm_sdxl` refuses otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tasks.lora_tools.ldm import UNET_PREFIX, Mapper as _Mapper, unet_to_ldm  # noqa: F401 (UNET_PREFIX: re-exported)

VAE_PREFIX = "first_stage_model."
SD15_CLIP_PREFIX = "cond_stage_model.transformer.text_model."
SDXL_CLIP_L_PREFIX = "conditioner.embedders.0.transformer.text_model."
SDXL_CLIP_G_PREFIX = "conditioner.embedders.1.model."


def _component(folder: Path, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    config = json.loads((folder / name / "config.json").read_text())
    weights = [p for p in (folder / name).glob("*.safetensors")]
    if len(weights) != 1:
        raise ValueError(f"{folder / name}: expected one .safetensors file, found {[p.name for p in weights]}")
    return config, load_file(weights[0])


# diffusers ResnetBlock2D -> ldm ResnetBlock (VAE): same names but the shortcut
_VAE_RESNET = (("conv_shortcut.", "nin_shortcut."),)


def ldm_unet(folder: Path) -> dict[str, torch.Tensor]:
    return unet_to_ldm(*_component(folder, "unet"))


def _vae(folder: Path) -> dict[str, torch.Tensor]:
    config, sd = _component(folder, "vae")
    m = _Mapper(sd, "vae")
    for d, o in (("conv_in", "conv_in"), ("conv_out", "conv_out"), ("conv_norm_out", "norm_out")):
        for side in ("encoder", "decoder"):
            for p in ("weight", "bias"):
                m.move(f"{side}.{d}.{p}", f"{side}.{o}.{p}")
    for d in ("quant_conv", "post_quant_conv"):
        if f"{d}.weight" in sd:
            for p in ("weight", "bias"):
                m.move(f"{d}.{p}", f"{d}.{p}")
    n, layers = len(config["down_block_types"]), config["layers_per_block"]
    for i in range(n):
        for j in range(layers):
            m.move_prefix(f"encoder.down_blocks.{i}.resnets.{j}.", f"encoder.down.{i}.block.{j}.", _VAE_RESNET)
        if i < n - 1:
            m.move_prefix(f"encoder.down_blocks.{i}.downsamplers.0.conv.", f"encoder.down.{i}.downsample.conv.")
    for i in range(n):  # the decoder's up_blocks run deepest-first; ldm numbers `up` by resolution
        for j in range(layers + 1):
            m.move_prefix(f"decoder.up_blocks.{i}.resnets.{j}.", f"decoder.up.{n - 1 - i}.block.{j}.", _VAE_RESNET)
        if i < n - 1:
            m.move_prefix(f"decoder.up_blocks.{i}.upsamplers.0.conv.", f"decoder.up.{n - 1 - i}.upsample.conv.")
    for side in ("encoder", "decoder"):
        m.move_prefix(f"{side}.mid_block.resnets.0.", f"{side}.mid.block_1.", _VAE_RESNET)
        m.move_prefix(f"{side}.mid_block.resnets.1.", f"{side}.mid.block_2.", _VAE_RESNET)
        a, o = f"{side}.mid_block.attentions.0.", f"{side}.mid.attn_1."
        for d, k in (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
            # ldm's AttnBlock uses 1x1 convs: [C, C] linear weights become [C, C, 1, 1]
            m.move(f"{a}{d}.weight", f"{o}{k}.weight", (lambda t: t[:, :, None, None]) if k != "norm" else None)
            m.move(f"{a}{d}.bias", f"{o}{k}.bias")
    return m.done(VAE_PREFIX)


def _clip_text_model(folder: Path, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """transformers >= 5.6 saves CLIPTextModel without the `text_model.` level (CLIPTextModelWithProjection
    keeps it); return keys relative to `text_model` either way, plus `text_projection.weight` if any."""
    config, sd = _component(folder, name)
    out = {}
    for k, v in sd.items():
        if k.startswith("text_model."):
            k = k[len("text_model."):]
        elif not k.startswith(("embeddings.", "encoder.", "final_layer_norm.", "text_projection.")):
            raise ValueError(f"{name}: unexpected CLIP key {k}")
        out[k] = v
    return config, out


def _clip_l(folder: Path, name: str, prefix: str) -> dict[str, torch.Tensor]:
    _, sd = _clip_text_model(folder, name)
    if "text_projection.weight" in sd:
        raise ValueError(f"{name}: the original layout has no place for CLIP-L's text_projection")
    return {prefix + k: v.contiguous() for k, v in sd.items()}


def _open_clip(folder: Path, name: str, prefix: str) -> dict[str, torch.Tensor]:
    """CLIPTextModelWithProjection -> OpenCLIP text tower (`transformer.resblocks.N`, fused in_proj)."""
    config, sd = _clip_text_model(folder, name)
    m = _Mapper(sd, name)
    m.move("embeddings.position_embedding.weight", "positional_embedding")
    m.move("embeddings.token_embedding.weight", "token_embedding.weight")
    m.move("final_layer_norm.weight", "ln_final.weight")
    m.move("final_layer_norm.bias", "ln_final.bias")
    m.move("text_projection.weight", "text_projection", lambda t: t.T)  # open_clip: x @ text_projection
    for i in range(config["num_hidden_layers"]):
        d, o = f"encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for p in ("weight", "bias"):
            qkv = [f"{d}self_attn.{x}_proj.{p}" for x in "qkv"]
            m.out[f"{o}attn.in_proj_{p}"] = torch.cat([sd[k] for k in qkv]).contiguous()
            m.used.update(qkv)
            m.move(f"{d}self_attn.out_proj.{p}", f"{o}attn.out_proj.{p}")
            m.move(f"{d}layer_norm1.{p}", f"{o}ln_1.{p}")
            m.move(f"{d}layer_norm2.{p}", f"{o}ln_2.{p}")
            m.move(f"{d}mlp.fc1.{p}", f"{o}mlp.c_fc.{p}")
            m.move(f"{d}mlp.fc2.{p}", f"{o}mlp.c_proj.{p}")
    return m.done(prefix)


def to_ldm_sd15(pipeline_dir: str | Path) -> dict[str, torch.Tensor]:
    """A1111 / CompVis SD1.x single-file state dict (UNet + VAE + CLIP-L) of a diffusers folder."""
    folder = Path(pipeline_dir)
    return {**ldm_unet(folder), **_vae(folder), **_clip_l(folder, "text_encoder", SD15_CLIP_PREFIX)}


def to_ldm_sdxl(pipeline_dir: str | Path) -> dict[str, torch.Tensor]:
    """Stability SGM SDXL single-file state dict (UNet + VAE + CLIP-L + OpenCLIP-G) of a diffusers folder."""
    folder = Path(pipeline_dir)
    width = [json.loads((folder / n / "config.json").read_text())["hidden_size"]
             for n in ("text_encoder", "text_encoder_2")]
    if width[0] == width[1]:
        raise ValueError(f"text_encoder and text_encoder_2 are both {width[0]} wide: diffusers' from_single_file "
                         "would load CLIP-L's weights into text_encoder_2 (build with a different clip_2_hidden_size)")
    return {**ldm_unet(folder), **_vae(folder), **_clip_l(folder, "text_encoder", SDXL_CLIP_L_PREFIX),
            **_open_clip(folder, "text_encoder_2", SDXL_CLIP_G_PREFIX)}
