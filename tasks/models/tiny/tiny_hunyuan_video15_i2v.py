"""A tiny, deterministic HunyuanVideo 1.5 image-to-video pipeline (`HunyuanVideo15ImageToVideoPipeline`, the
hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v layout) built offline from the real diffusers/transformers
classes, in the same conventions as tiny_hunyuan_video15.py, whose components (seeds 0-3) it shares.

What the image-to-video model differs in (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py:
TRANSFORMER_CONFIGS["480p_i2v"] and `load_siglip`):
- the transformer's config: task_type "i2v" (the same in_channels 2C + 1 = 65: noisy latents | the first frame's
  latent, zero after it | its mask; image_embed_dim = the SigLIP width, 1152 there);
- two components more: `image_encoder`, a SiglipVisionModel (FLUX.1-Redux-dev's SigLIP so400m-patch14-384: 729
  tokens of 1152), whose last_hidden_state the pipeline feeds as `image_embeds`, and `feature_extractor`, its
  SiglipImageProcessor (resize to the encoder's square, rescale, normalise by 0.5 / 0.5). Tiny: 32 px in 8 px
  patches (16 tokens) of `image_embed_dim`."""
from __future__ import annotations

from pathlib import Path

from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_hunyuan_video15 import HV15_ARCH, hv15_parts
from tasks.models.tiny.tiny_hunyuan_video15 import LEARNS as HV15_LEARNS

HV15_I2V_ARCH: dict = {**HV15_ARCH,
                       # SiglipVisionModel: hidden size = the transformer's image_embed_dim (derived, not a key)
                       "siglip_layers": 1, "siglip_heads": 2, "siglip_intermediate_size": 32,
                       "siglip_image_size": 32, "siglip_patch": 8}


def build_tiny_hunyuan_video15_i2v(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `HunyuanVideo15ImageToVideoPipeline` saved in diffusers layout under `out_dir`."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipVisionConfig, SiglipVisionModel
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    a = resolve_arch(HV15_I2V_ARCH, arch)
    seeded = seeder(seed, 5)
    parts = hv15_parts(a, seeded, "i2v")
    image_encoder = seeded(4, lambda: SiglipVisionModel(SiglipVisionConfig(
        hidden_size=a["image_embed_dim"], intermediate_size=a["siglip_intermediate_size"],
        num_hidden_layers=a["siglip_layers"], num_attention_heads=a["siglip_heads"],
        image_size=a["siglip_image_size"], patch_size=a["siglip_patch"])))
    # the PIL processor (SiglipImageProcessor without torchvision): the same resize, rescale and normalisation
    size = a["siglip_image_size"]
    feature_extractor = SiglipImageProcessorPil(size={"height": size, "width": size})
    pipe = HunyuanVideo15ImageToVideoPipeline(**parts, image_encoder=image_encoder, feature_extractor=feature_extractor)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# The same clip from its first frame, rendered by HunyuanVideo15ImageToVideoPipeline (sized by its own rule: the
# target_size bucket nearest the image's aspect, the check's size for the square first frame)
LEARNS = {"tiny_hunyuan_video15_i2v": {**HV15_LEARNS["tiny_hunyuan_video15"], "i2v": True}}
