"""A tiny, deterministic HunyuanVideo 1.5 text-to-video pipeline (`HunyuanVideo15Pipeline`, the
hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v layout) built offline from the real diffusers/transformers
classes: HunyuanVideo15Transformer3DModel (54 -> `num_layers` double-stream blocks, the token refiner, the ByT5 and
image projections), AutoencoderKLHunyuanVideo15 (the causal video VAE: /16 in space, /4 in time, 1 + 4k frames),
a Qwen2.5-VL text model (Qwen2_5_VLTextModel) with a Qwen2 tokenizer and chat template, a T5 encoder with the
(vocabulary-free) ByT5 tokenizer for quoted glyph text, the flow-matching Euler scheduler (shift 5.0, the 480p t2v
one) and the ClassifierFreeGuidance guider (6.0), as diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py
assembles them.

Conventions of common.py: weights depend only on `seed` (same seed -> byte-identical
files), one seed per component, the caller's global RNG is untouched, `arch` overrides keys of `HV15_ARCH`
(unknown key -> ValueError).

The pipeline drops the first 108 tokens of its chat template (`prompt_template_encode_start_idx`: the system
message, counted with the real Qwen2.5-VL tokenizer). The tiny tokenizer learns its merges with that message
weighted in (qwenimage.qwen25vl_tokenizer), so every word of it is one token and the same 108 tokens are
the template (tests/test_hunyuan_video15.py checks it)."""
from __future__ import annotations

from pathlib import Path

from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_qwenimage import qwen25vl_tokenizer

HV15_ARCH: dict = {
    # HunyuanVideo15Transformer3DModel: inner dim = heads x head dim; rope_axes_dim sums to the head dim;
    # text_embed_dim = the Qwen width, text_embed_2_dim = the T5 width (the ByT5 projection's 2048 is fixed)
    "num_layers": 2, "num_refiner_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8,
    "rope_axes_dim": (2, 2, 4), "image_embed_dim": 16,
    # AutoencoderKLHunyuanVideo15: five levels, the first four halve the sides (/16), the 3rd and 4th the time (/4)
    "latent_channels": 8, "vae_block_out_channels": (8, 8, 16, 16, 16), "vae_layers_per_block": 1,
    "scaling_factor": 1.03682,  # the real VAE's
    # Qwen2_5_VLTextModel: the pipeline reads hidden_states[-3], so 3 layers put one layer under it
    "qwen_hidden_size": 32, "qwen_layers": 3, "qwen_heads": 2, "qwen_kv_heads": 2, "qwen_intermediate_size": 37,
    "qwen_mrope_section": (2, 2, 4), "qwen_num_merges": 400,
    # T5EncoderModel under the ByT5 tokenizer (Glyph-SDXL-v2's byt5-small is 1472 wide)
    "t5_d_model": 16, "t5_d_kv": 8, "t5_d_ff": 32, "t5_layers": 1, "t5_heads": 2,
    "shift": 5.0, "guidance_scale": 6.0,  # 480p_t2v's SCHEDULER_CONFIGS / GUIDANCE_CONFIGS in the converter
}


def _system_message() -> str:
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import HunyuanVideo15Pipeline

    # the default of the pipeline's own encoder helper: the same text as its `system_message` attribute
    defaults = HunyuanVideo15Pipeline._get_mllm_prompt_embeds.__defaults__
    return next(d for d in defaults if isinstance(d, str))


def _qwen(a: dict, tokenizer):
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=a["qwen_hidden_size"], intermediate_size=a["qwen_intermediate_size"],
        num_hidden_layers=a["qwen_layers"], num_attention_heads=a["qwen_heads"],
        num_key_value_heads=a["qwen_kv_heads"], max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": list(a["qwen_mrope_section"])},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]))


def _t5(a: dict, tokenizer):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=a["t5_d_model"], d_kv=a["t5_d_kv"], d_ff=a["t5_d_ff"],
        num_layers=a["t5_layers"], num_heads=a["t5_heads"], feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id))


def hv15_parts(a: dict, seeded, task_type: str) -> dict:
    """The components HunyuanVideo15Pipeline and HunyuanVideo15ImageToVideoPipeline share (seeds 0-3), the
    transformer's `task_type` as the converter's TRANSFORMER_CONFIGS give it ("t2v" / "i2v")."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer

    tokenizer = qwen25vl_tokenizer(a["qwen_num_merges"], system=_system_message())
    tokenizer_2 = ByT5Tokenizer()  # bytes + 3 specials + 125 sentinels: no vocabulary file
    c = a["latent_channels"]
    transformer = seeded(0, lambda: HunyuanVideo15Transformer3DModel(
        in_channels=2 * c + 1, out_channels=c,  # noisy latents | condition latents | condition mask
        num_attention_heads=a["num_attention_heads"], attention_head_dim=a["attention_head_dim"],
        num_layers=a["num_layers"], num_refiner_layers=a["num_refiner_layers"], mlp_ratio=4.0, patch_size=1,
        patch_size_t=1, qk_norm="rms_norm", text_embed_dim=a["qwen_hidden_size"], text_embed_2_dim=a["t5_d_model"],
        image_embed_dim=a["image_embed_dim"], rope_theta=256.0, rope_axes_dim=tuple(a["rope_axes_dim"]),
        target_size=640, task_type=task_type, use_meanflow=False))
    vae = seeded(1, lambda: AutoencoderKLHunyuanVideo15(
        latent_channels=c, block_out_channels=tuple(a["vae_block_out_channels"]),
        layers_per_block=a["vae_layers_per_block"], spatial_compression_ratio=16, temporal_compression_ratio=4,
        scaling_factor=a["scaling_factor"]))
    text_encoder = seeded(2, lambda: _qwen(a, tokenizer))
    text_encoder_2 = seeded(3, lambda: _t5(a, tokenizer_2))
    return dict(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=a["shift"]),
                text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                guider=ClassifierFreeGuidance(guidance_scale=a["guidance_scale"]))


def build_tiny_hunyuan_video15(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `HunyuanVideo15Pipeline` (text-to-video) saved in diffusers layout under `out_dir`.
    Clips are 1 + 4k frames, sides multiples of 16; call with e.g. height/width 32, num_frames 5 and the pipeline's
    `tokenizer_max_length` set small (tasks/models/hunyuan_video15.py sets it from model.max_sequence_length)."""
    from diffusers import HunyuanVideo15Pipeline

    a = resolve_arch(HV15_ARCH, arch)
    pipe = HunyuanVideo15Pipeline(**hv15_parts(a, seeder(seed, 4), "t2v"))
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# The clip, its kohya file merged by ComfyUI's rule (diffusers reads none for it). The default tiny model (16 wide)
# reaches 0.199 / 0.193 after 600 / 1200 steps at lr 1e-2; twice as wide, 300 steps at 3e-3 (at 1e-2 it memorises
# so hard that a halved scale or a misnamed block still renders under the bound)
LEARNS = {"tiny_hunyuan_video15": {"arch": {"num_attention_heads": 4, "attention_head_dim": 16,
                                            "rope_axes_dim": [4, 4, 8]}, "rank": 16, "steps": 300, "lr": 3e-3,
                                   "clip": True}}
