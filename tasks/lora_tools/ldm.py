"""diffusers UNet state dict -> the original (LDM / SGM) layout: `model.diffusion_model.*`, the keys A1111/Forge,
ComfyUI and sd-scripts read in SD1.x and SDXL single files, and that diffusers' `UNet2DConditionModel.from_single_file`
converts back (`convert_ldm_unet_checkpoint`). `merge --into-base --layout original` writes it.

The reverse of diffusers' converter, as in diffusers' scripts/convert_diffusers_to_original_stable_diffusion.py,
but the block index arithmetic is read from the UNet's config instead of being hard-coded to layers_per_block=2
and 4 levels, so the tiny test models convert too. Every tensor maps to exactly one key, and the conversion
raises if one is left over. tests/ldm_convert.py (VAE and text encoders, for whole-pipeline files) builds on it."""
from __future__ import annotations

from tasks.lazy import lazy

torch = lazy("torch")

UNET_PREFIX = "model.diffusion_model."

# diffusers ResnetBlock2D -> ldm ResBlock (UNet)
UNET_RESNET = (("norm1.", "in_layers.0."), ("conv1.", "in_layers.2."), ("time_emb_proj.", "emb_layers.1."),
               ("norm2.", "out_layers.0."), ("conv2.", "out_layers.3."), ("conv_shortcut.", "skip_connection."))


class Mapper:
    """Moves tensors from a diffusers state dict to original keys; `done()` insists every one moved."""

    def __init__(self, sd: dict, what: str):
        self.sd, self.what, self.used, self.out = sd, what, set(), {}

    def move(self, src: str, dst: str, transform=None) -> None:
        tensor = self.sd[src]
        self.used.add(src)
        self.out[dst] = (transform(tensor) if transform else tensor).contiguous()

    def move_prefix(self, src: str, dst: str, renames: tuple[tuple[str, str], ...] = ()) -> None:
        """All keys starting with `src` (a module path ending in '.'), re-rooted at `dst`, with in-key renames."""
        keys = [k for k in self.sd if k.startswith(src)]
        if not keys:
            raise KeyError(f"{self.what}: no keys under {src!r}")
        for key in keys:
            rest = key[len(src):]
            for old, new in renames:
                rest = rest.replace(old, new)
            self.move(key, dst + rest)

    def done(self, prefix: str) -> dict:
        left = sorted(set(self.sd) - self.used)
        if left:
            raise ValueError(f"{self.what}: tensors with no original-layout key: {left}")
        return {prefix + k: v for k, v in self.out.items()}


def unet_to_ldm(config: dict, sd: dict) -> dict:
    """A UNet2DConditionModel's config and state dict (SD1.x or SDXL) -> `model.diffusion_model.*` keys."""
    m = Mapper(sd, "unet")
    for d, o in (("time_embedding.linear_1", "time_embed.0"), ("time_embedding.linear_2", "time_embed.2"),
                 ("conv_in", "input_blocks.0.0"), ("conv_norm_out", "out.0"), ("conv_out", "out.2")):
        for p in ("weight", "bias"):
            m.move(f"{d}.{p}", f"{o}.{p}")
    if config.get("addition_embed_type") == "text_time":  # SDXL: pooled text + size/crop embedding
        for d, o in (("add_embedding.linear_1", "label_emb.0.0"), ("add_embedding.linear_2", "label_emb.0.2")):
            for p in ("weight", "bias"):
                m.move(f"{d}.{p}", f"{o}.{p}")
    elif config.get("addition_embed_type") or config.get("class_embed_type"):
        raise NotImplementedError("unet with class/addition embeddings other than SDXL's text_time")

    layers, n = config["layers_per_block"], len(config["block_out_channels"])
    if not isinstance(layers, int):
        raise NotImplementedError("per-block layers_per_block")
    # input_blocks: 0 = conv_in, then per level `layers` (resnet[, attention]) + one downsampler (not the last level)
    for b in range(n):
        for j in range(layers):
            i = 1 + b * (layers + 1) + j
            m.move_prefix(f"down_blocks.{b}.resnets.{j}.", f"input_blocks.{i}.0.", UNET_RESNET)
            if any(k.startswith(f"down_blocks.{b}.attentions.{j}.") for k in sd):
                m.move_prefix(f"down_blocks.{b}.attentions.{j}.", f"input_blocks.{i}.1.")
        if b < n - 1:
            m.move_prefix(f"down_blocks.{b}.downsamplers.0.conv.",
                          f"input_blocks.{1 + b * (layers + 1) + layers}.0.op.")
    m.move_prefix("mid_block.resnets.0.", "middle_block.0.", UNET_RESNET)
    m.move_prefix("mid_block.attentions.0.", "middle_block.1.")
    m.move_prefix("mid_block.resnets.1.", "middle_block.2.", UNET_RESNET)
    # output_blocks: per level `layers + 1` (resnet[, attention]), the level's last one also holds the upsampler
    for b in range(n):
        for j in range(layers + 1):
            i = b * (layers + 1) + j
            m.move_prefix(f"up_blocks.{b}.resnets.{j}.", f"output_blocks.{i}.0.", UNET_RESNET)
            has_attention = any(k.startswith(f"up_blocks.{b}.attentions.{j}.") for k in sd)
            if has_attention:
                m.move_prefix(f"up_blocks.{b}.attentions.{j}.", f"output_blocks.{i}.1.")
        if b < n - 1:
            m.move_prefix(f"up_blocks.{b}.upsamplers.0.conv.",
                          f"output_blocks.{b * (layers + 1) + layers}.{2 if has_attention else 1}.conv.")
    # Transformer2DModel / BasicTransformerBlock keep their names in the original layout (SpatialTransformer).
    return m.done(UNET_PREFIX)
