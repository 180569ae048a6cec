"""Tiny, deterministic SDXL and SD1.5 pipelines (the UNet families) built offline from real diffusers/transformers
classes (conventions: tasks/models/tiny/common.py)."""
from __future__ import annotations

from pathlib import Path

from diffusers import (
    DDIMScheduler, EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from tasks.models.tiny.common import (
    CLIP_ARCH, VAE_ARCH, clip_tokenizer, clip_tokenizer_2, make_clip, make_vae, resolve_arch, sd_betas, seeder,
)


SDXL_ARCH: dict = {
    # UNet2DConditionModel as in diffusers' SDXL fast tests. cross_attention_dim = clip_hidden_size +
    # clip_2_hidden_size (64); projection_class_embeddings_input_dim = 6 * addition_time_embed_dim +
    # clip_2_projection_dim (80: six add_time_ids, each sinusoidally embedded, plus the pooled text_embeds).
    "sample_size": 32, "block_out_channels": (32, 64), "layers_per_block": 2, "attention_head_dim": (2, 4),
    "transformer_layers_per_block": (1, 2), "addition_time_embed_dim": 8, "norm_num_groups": 32,
    **VAE_ARCH, **CLIP_ARCH, "clip_2_hidden_size": 32, "clip_2_projection_dim": 32,
}


SD15_ARCH: dict = {
    # UNet2DConditionModel; cross_attention_dim = clip_hidden_size (32). sample_size 8 -> 64 px by default.
    "sample_size": 8, "block_out_channels": (32, 64), "layers_per_block": 1, "attention_head_dim": 8,
    "norm_num_groups": 32,
    **VAE_ARCH, **CLIP_ARCH,
}


def build_tiny_sdxl(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `StableDiffusionXLPipeline` saved in diffusers layout under `out_dir`.

    Keys of `SDXL_ARCH`: UNet (sample_size, block_out_channels, layers_per_block, attention_head_dim
    [= heads per block, diffusers' legacy name], transformer_layers_per_block, addition_time_embed_dim,
    norm_num_groups), VAE (latent_channels, vae_*), CLIPTextModel (clip_*) and
    CLIPTextModelWithProjection (clip_2_hidden_size, clip_2_projection_dim; other clip_* shared).
    The default UNet sample_size 32 means a 256 px default resolution: pass height/width (e.g. 64).
    """
    a = resolve_arch(SDXL_ARCH, arch)
    tokenizer, tokenizer_2 = clip_tokenizer(a["clip_num_merges"]), clip_tokenizer_2(a)
    seeded = seeder(seed, 4)
    unet = seeded(0, lambda: UNet2DConditionModel(
        sample_size=a["sample_size"], in_channels=a["latent_channels"], out_channels=a["latent_channels"],
        block_out_channels=tuple(a["block_out_channels"]), layers_per_block=a["layers_per_block"],
        # SDXL's first level has no attention; the deeper ones cross-attend to the text
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(a["block_out_channels"]) - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (len(a["block_out_channels"]) - 1) + ("UpBlock2D",),
        attention_head_dim=tuple(a["attention_head_dim"]), use_linear_projection=True,
        transformer_layers_per_block=tuple(a["transformer_layers_per_block"]), norm_num_groups=a["norm_num_groups"],
        cross_attention_dim=a["clip_hidden_size"] + a["clip_2_hidden_size"],  # both encoders' hidden states, concatenated
        addition_embed_type="text_time", addition_time_embed_dim=a["addition_time_embed_dim"],
        projection_class_embeddings_input_dim=6 * a["addition_time_embed_dim"] + a["clip_2_projection_dim"],
    ))
    vae = seeded(1, lambda: make_vae(a, scaling_factor=0.13025))  # SDXL VAE value
    text_encoder = seeded(2, lambda: make_clip(CLIPTextModel, a, tokenizer, a["clip_hidden_size"], a["clip_hidden_size"]))
    text_encoder_2 = seeded(3, lambda: make_clip(CLIPTextModelWithProjection, a, tokenizer_2,
                                             a["clip_2_hidden_size"], a["clip_2_projection_dim"]))
    scheduler = EulerDiscreteScheduler(**sd_betas(), timestep_spacing="leading")  # SDXL base scheduler config
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler,
        # not saved in model_index.json: from_pretrained re-enables it iff invisible-watermark is installed
        add_watermarker=False,
    )
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_tiny_sd15(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `StableDiffusionPipeline` (SD1.5 layout, no safety checker) under `out_dir`.

    Keys of `SD15_ARCH`: UNet (sample_size, block_out_channels, layers_per_block, attention_head_dim
    [= heads], norm_num_groups), VAE (latent_channels, vae_*), CLIPTextModel (clip_*). Defaults give
    64 px images.
    """
    a = resolve_arch(SD15_ARCH, arch)
    tokenizer = clip_tokenizer(a["clip_num_merges"])
    seeded = seeder(seed, 3)
    n = len(a["block_out_channels"])
    unet = seeded(0, lambda: UNet2DConditionModel(
        sample_size=a["sample_size"], in_channels=a["latent_channels"], out_channels=a["latent_channels"],
        block_out_channels=tuple(a["block_out_channels"]), layers_per_block=a["layers_per_block"],
        # SD1.5: cross-attention at every level but the deepest
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        attention_head_dim=a["attention_head_dim"], norm_num_groups=a["norm_num_groups"],
        cross_attention_dim=a["clip_hidden_size"],
    ))
    vae = seeded(1, lambda: make_vae(a, scaling_factor=0.18215))  # SD1.x VAE value
    text_encoder = seeded(2, lambda: make_clip(CLIPTextModel, a, tokenizer, a["clip_hidden_size"], a["clip_hidden_size"]))
    # DDIM with SD1.5's betas: exact for any step count (PNDM's PLMS warm-up makes 2 steps odd)
    scheduler = DDIMScheduler(**sd_betas(), clip_sample=False, set_alpha_to_one=False)
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# The default targets (attention) suit a pretrained base; a random tiny one must learn to denoise the image from
# scratch, and a LoRA on attention alone cannot hold that: the MLPs and the convolutions too.
_UNET = ["to_k", "to_q", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out", "time_emb_proj",
         "conv1", "conv2", "conv_in", "conv_out"]
LEARNS = {"tiny_sdxl": {"arch": {}, "rank": 16, "steps": 300, "lr": 3e-3, "targets": _UNET},
          "tiny_sd15": {"arch": {}, "rank": 16, "steps": 300, "lr": 1e-3, "targets": _UNET}}
