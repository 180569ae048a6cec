"""A tiny, deterministic Krea 2 pipeline (Krea2Transformer2DModel, the Qwen-Image VAE, a Qwen3-VL text encoder) built
offline from real diffusers/transformers classes (conventions: tasks/models/tiny/common.py). The tokenizer is
Qwen-Image's tiny Qwen2.5-VL one: Krea2Pipeline writes the same system template by hand (not the tokenizer's chat
template) and drops the same 34 prefix tokens, which that tokenizer keeps whole-word (tiny_qwenimage.py)."""
from __future__ import annotations

from pathlib import Path

from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLModel

from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_qwenimage import QWEN25VL_SPECIALS, qwen25vl_tokenizer

KREA2_ARCH: dict = {
    # Krea2Transformer2DModel: width = heads x head_dim; GQA as the real one (48 query / 12 key-value heads);
    # axes_dims_rope sum to attention_head_dim (ComfyUI's split: head - 12 (head // 16), 6 (head // 16) twice)
    "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
    "intermediate_size": 64, "timestep_embed_dim": 32, "axes_dims_rope": (4, 6, 6),
    # the text fusion stage: 2 layerwise + 2 refiner blocks, as the real model (ComfyUI hard-codes 2 and 2)
    "text_num_attention_heads": 2, "text_intermediate_size": 48,
    # AutoencoderKLQwenImage: 3 downsamplings -> /8 as the real one
    "z_dim": 4, "vae_base_dim": 8, "vae_dim_mult": (1, 2, 4, 4), "vae_num_res_blocks": 1,
    # Qwen3VLModel's text model (a 1-block vision tower Krea 2 never runs); every layer's state is tapped (the
    # real pipeline taps 12 of Qwen3-VL-4B's 36: hidden states 2, 5, ..., 35)
    "qwen_hidden_size": 32, "qwen_layers": 3, "qwen_heads": 2, "qwen_kv_heads": 1, "qwen_head_dim": 16,
    "qwen_intermediate_size": 37, "qwen_mrope_section": (4, 2, 2),  # sums to head_dim / 2
    "qwen_num_merges": 400,
}


def build_tiny_krea2(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `Krea2Pipeline` (Krea 2 Raw layout: is_distilled False) saved in diffusers layout under
    `out_dir`. Keys of `KREA2_ARCH`. Images are multiples of 16 px; call with e.g. 64 px and max_sequence_length=32."""
    a = resolve_arch(KREA2_ARCH, arch)
    tokenizer = qwen25vl_tokenizer(a["qwen_num_merges"])
    seeded = seeder(seed, 3)
    layers = tuple(range(1, a["qwen_layers"] + 1))  # hidden_states[0] is the embedding output
    transformer = seeded(0, lambda: Krea2Transformer2DModel(
        in_channels=4 * a["z_dim"], num_layers=a["num_layers"], attention_head_dim=a["attention_head_dim"],
        num_attention_heads=a["num_attention_heads"], num_key_value_heads=a["num_key_value_heads"],
        intermediate_size=a["intermediate_size"], timestep_embed_dim=a["timestep_embed_dim"],
        text_hidden_dim=a["qwen_hidden_size"], num_text_layers=len(layers),
        text_num_attention_heads=a["text_num_attention_heads"], text_num_key_value_heads=a["text_num_attention_heads"],
        text_intermediate_size=a["text_intermediate_size"], axes_dims_rope=tuple(a["axes_dims_rope"]),
    ))
    # Krea2RMSNorm's scales start at zero (multiplier 1 + w); the checkpoint's are trained: random here, so a test
    # that drops a norm (or its zero-centring) sees it
    with_random_norms(transformer, seed)
    n = len(a["vae_dim_mult"])
    vae = seeded(1, lambda: AutoencoderKLQwenImage(
        base_dim=a["vae_base_dim"], z_dim=a["z_dim"], dim_mult=list(a["vae_dim_mult"]),
        num_res_blocks=a["vae_num_res_blocks"], temperal_downsample=[False] + [True] * (n - 2),
        latents_mean=[round(0.1 * (i - a["z_dim"] / 2), 4) for i in range(a["z_dim"])],
        latents_std=[round(1.0 + 0.25 * i, 4) for i in range(a["z_dim"])],
    ))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN25VL_SPECIALS}
    text_encoder = seeded(2, lambda: Qwen3VLModel(Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=a["qwen_hidden_size"],
                         intermediate_size=a["qwen_intermediate_size"], num_hidden_layers=a["qwen_layers"],
                         num_attention_heads=a["qwen_heads"], num_key_value_heads=a["qwen_kv_heads"],
                         head_dim=a["qwen_head_dim"], max_position_embeddings=2048, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": list(a["qwen_mrope_section"]), "mrope_interleaved": True},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=a["qwen_hidden_size"], deepstack_visual_indexes=[0],
                           num_position_embeddings=64),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )))
    # the pipeline docstring's scheduler: Krea 2's resolution-aware exponential shift
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=6400, time_shift_type="exponential")
    pipe = Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer, text_encoder_select_layers=layers, is_distilled=False, patch_size=2)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def with_random_norms(transformer, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or name.endswith("scale_shift_table"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


# The learning check's settings (bench/learns.py; bench/learns_settings.py gathers every family's): the tiny model's
# width (model.arch) and the run that memorises one image, each choice's measured reason beside it. 4 heads (64 wide,
# as tiny_qwenimage's check), rank 16, lr 3e-3, 300 steps (the other image families' run): ratio 0.070 for the
# diffusers and the merged kohya file (76 s on 2 cores), 0.064-0.076 on the four generated images; a misnamed block
# (0.406) and a halved scale (0.486) are caught. At the default 2 heads (32 wide) the same run stays at 0.265.
LEARNS = {"tiny_krea2": {"arch": {"num_attention_heads": 4}, "rank": 16, "steps": 300, "lr": 3e-3}}
