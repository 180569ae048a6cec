"""A tiny, deterministic Qwen-Image pipeline (Qwen2.5-VL text encoder) built offline from real diffusers/transformers
classes (conventions: tasks/models/tiny/common.py); its parts are Qwen-Image-Edit's too (tiny_qwenimage_edit.py)."""
from __future__ import annotations

from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler
from transformers import Qwen2Tokenizer

from tasks.models.tiny.common import corpus, qwen_bpe_tokenizer, resolve_arch, seeder


# Qwen-Image's encoding prompt (QwenImagePipeline.prompt_template_encode): the pipeline drops its first 34
# tokens (prompt_template_encode_start_idx), counted with the real Qwen2.5-VL tokenizer. The tiny tokenizer
# learns its merges with this text weighted in, so every word of the prefix is one token there too and the
# same 34 tokens are dropped (tests/test_qwenimage.py checks it).
QWENIMAGE_SYSTEM = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
                    "relationships of the objects and background:")


QWEN25VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                      "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


QWEN25VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen25vl_tokenizer(num_merges: int, system: str = QWENIMAGE_SYSTEM) -> Qwen2Tokenizer:
    """Qwen2.5-VL's layout: byte-level BPE, <|endoftext|> pad, <|im_end|> eos, the vision specials; `system`:
    the pipeline's template text, learnt whole-word so its dropped prefix has the real tokenizer's length."""
    lines = corpus() + [system, "system", "user", "assistant"] * 40  # role names start a line
    return qwen_bpe_tokenizer(num_merges, lines, QWEN25VL_SPECIALS, QWEN25VL_CHAT_TEMPLATE)


QWENIMAGE_ARCH: dict = {
    # QwenImageTransformer2DModel; joint_attention_dim = qwen_hidden_size; axes_dims_rope sum to attention_head_dim
    "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "axes_dims_rope": (4, 6, 6),
    # AutoencoderKLQwenImage: 3 downsamplings -> /8 as the real one (temporal ones are no-ops on one frame)
    "z_dim": 4, "vae_base_dim": 8, "vae_dim_mult": (1, 2, 4, 4), "vae_num_res_blocks": 1,
    # Qwen2_5_VLForConditionalGeneration (text model; a 1-layer vision tower that Qwen-Image never runs)
    "qwen_hidden_size": 32, "qwen_layers": 2, "qwen_heads": 2, "qwen_kv_heads": 2, "qwen_intermediate_size": 37,
    "qwen_mrope_section": (2, 2, 4),  # sums to head_dim / 2 (head_dim = hidden / heads = 16)
    "qwen_num_merges": 400,
}


def build_tiny_qwenimage(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `QwenImagePipeline` (Qwen-Image layout) saved in diffusers layout under `out_dir`.

    Keys of `QWENIMAGE_ARCH`: transformer (num_layers, attention_head_dim, num_attention_heads,
    axes_dims_rope), AutoencoderKLQwenImage (z_dim, vae_*), Qwen2.5-VL text model (qwen_*). Images are
    multiples of 16 px; call with e.g. height/width 64 and `max_sequence_length=32`.
    """
    from diffusers import QwenImagePipeline

    a = resolve_arch(QWENIMAGE_ARCH, arch)
    tokenizer = qwen25vl_tokenizer(a["qwen_num_merges"])
    pipe = QwenImagePipeline(tokenizer=tokenizer, **qwenimage_parts(a, tokenizer, seeder(seed, 3)))
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def qwenimage_parts(a: dict, tokenizer, seeded) -> dict:
    """Transformer, VAE, Qwen2.5-VL and scheduler of a tiny Qwen-Image pipeline (Qwen-Image-Edit's too)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN25VL_SPECIALS}
    transformer = seeded(0, lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * a["z_dim"], out_channels=a["z_dim"], num_layers=a["num_layers"],
        attention_head_dim=a["attention_head_dim"], num_attention_heads=a["num_attention_heads"],
        joint_attention_dim=a["qwen_hidden_size"], guidance_embeds=False, axes_dims_rope=tuple(a["axes_dims_rope"]),
    ))
    n = len(a["vae_dim_mult"])
    vae = seeded(1, lambda: AutoencoderKLQwenImage(
        base_dim=a["vae_base_dim"], z_dim=a["z_dim"], dim_mult=list(a["vae_dim_mult"]),
        num_res_blocks=a["vae_num_res_blocks"], temperal_downsample=[False] + [True] * (n - 2),
        # per-channel statistics as the real VAE has (its own 16 values are for z_dim 16)
        latents_mean=[round(0.1 * (i - a["z_dim"] / 2), 4) for i in range(a["z_dim"])],
        latents_std=[round(1.0 + 0.25 * i, 4) for i in range(a["z_dim"])],
    ))
    text_encoder = seeded(2, lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=a["qwen_hidden_size"],
                         intermediate_size=a["qwen_intermediate_size"], num_hidden_layers=a["qwen_layers"],
                         num_attention_heads=a["qwen_heads"], num_key_value_heads=a["qwen_kv_heads"],
                         max_position_embeddings=2048, rope_parameters={
                             "rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": list(a["qwen_mrope_section"])},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=a["qwen_hidden_size"], fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )))
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image's scheduler config
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
        invert_sigmas=False, stochastic_sampling=False, use_beta_sigmas=False, use_exponential_sigmas=False,
        use_karras_sigmas=False,
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer)

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
LEARNS = {"tiny_qwenimage": {"arch": {"num_attention_heads": 4}, "rank": 16, "steps": 300, "lr": 3e-3,
                              "targets": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                                          "to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                          "txt_mlp.net.2"]}}
