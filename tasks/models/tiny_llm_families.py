"""Tiny, deterministic pipelines of the families whose text encoder is a language model (Z-Image: Qwen3),
built offline from real diffusers/transformers classes.

Same conventions as tasks/models/tiny.py and tiny_families.py: weights depend only on `seed` (same seed ->
byte-identical files), the caller's global torch RNG is untouched, `arch` overrides keys of the family's
`*_ARCH` defaults (unknown key -> ValueError), and the tokenizer is a fixed-vocabulary byte-level BPE learned
deterministically from tiny.py's corpus (no download), in the real tokenizer class with a Qwen-style chat
template and special tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from tokenizers import pre_tokenizers
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from tasks.models.tiny import corpus, learn_bpe
from tasks.models.tiny_families import resolve_arch, seeder, VAE_ARCH

# Qwen3's chat template for what the pipelines render (one user turn + the generation prompt), with its
# enable_thinking switch: the real template appends an empty think block when thinking is off.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def _qwen_tokenizer(num_merges: int, chat_template: str = QWEN3_CHAT_TEMPLATE) -> Qwen2Tokenizer:
    """Byte-level BPE with Qwen2's pre-tokenizer (GPT-2 style, no end-of-word marker), Qwen's special
    tokens (<|endoftext|> = pad/unk, <|im_start|>, <|im_end|> = eos) and a chat template."""
    backend = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}, merges=[]).backend_tokenizer  # Qwen's pre-processing
    words = Counter(piece for line in corpus()
                    for piece, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(line)))
    merges = learn_bpe(words, num_merges, suffix="")
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in merges] + _QWEN_SPECIALS
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    # Qwen3's: eos <|im_end|> (the end of a chat turn, also its model config's eos), pad <|endoftext|>
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768, padding_side="right",
                               eos_token="<|im_end|>", additional_special_tokens=_QWEN_SPECIALS[1:])
    tokenizer.chat_template = chat_template
    return tokenizer


ZIMAGE_ARCH: dict = {
    # ZImageTransformer2DModel; cap_feat_dim = qwen_hidden_size; axes_dims sum to dim / n_heads
    "dim": 32, "n_layers": 1, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "axes_dims": (4, 6, 6),
    "axes_lens": (1536, 512, 512),  # Z-Image-Turbo's
    **VAE_ARCH,
    # Qwen3Model (Z-Image reads the hidden states before the last layer: layers >= 2)
    "qwen_hidden_size": 32, "qwen_layers": 2, "qwen_heads": 2, "qwen_kv_heads": 1, "qwen_head_dim": 16,
    "qwen_intermediate_size": 37, "qwen_num_merges": 300,
}


def _qwen3(a: dict, tokenizer) -> Qwen3Model:
    return Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=a["qwen_hidden_size"], intermediate_size=a["qwen_intermediate_size"],
        num_hidden_layers=a["qwen_layers"], num_attention_heads=a["qwen_heads"],
        num_key_value_heads=a["qwen_kv_heads"], head_dim=a["qwen_head_dim"], max_position_embeddings=1024,
        rope_theta=1000000.0, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    ))


def build_tiny_zimage(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `ZImagePipeline` (Z-Image-Turbo layout) saved in diffusers layout under `out_dir`.

    Keys of `ZIMAGE_ARCH`: transformer (dim, n_layers, n_refiner_layers, n_heads, n_kv_heads, axes_dims,
    axes_lens), VAE (latent_channels, vae_*: 4 blocks, /8 like the real FLUX.1 VAE Z-Image uses), Qwen3Model
    (qwen_*). Images are multiples of 16 px (VAE /8, then 2x2 patches); call with e.g. height/width 64 and
    `max_sequence_length=32`.
    """
    a = resolve_arch(ZIMAGE_ARCH, arch)
    tokenizer = _qwen_tokenizer(a["qwen_num_merges"])
    seeded = seeder(seed, 3)
    transformer = seeded(0, lambda: ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=a["latent_channels"], dim=a["dim"],
        n_layers=a["n_layers"], n_refiner_layers=a["n_refiner_layers"], n_heads=a["n_heads"],
        n_kv_heads=a["n_kv_heads"], norm_eps=1e-5, qk_norm=True, cap_feat_dim=a["qwen_hidden_size"],
        rope_theta=256.0, t_scale=1000.0, axes_dims=list(a["axes_dims"]), axes_lens=list(a["axes_lens"]),
    ))
    n = len(a["vae_block_out_channels"])
    vae = seeded(1, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(a["vae_block_out_channels"]), layers_per_block=a["vae_layers_per_block"],
        norm_num_groups=a["vae_norm_num_groups"], sample_size=64,
        scaling_factor=0.3611, shift_factor=0.1159,  # the FLUX.1 VAE, which Z-Image uses
        use_quant_conv=False, use_post_quant_conv=False,
    ))
    text_encoder = seeded(2, lambda: _qwen3(a, tokenizer))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,  # Z-Image-Turbo's
                                                use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# Qwen-Image's encoding prompt (QwenImagePipeline.prompt_template_encode): the pipeline drops its first 34
# tokens (prompt_template_encode_start_idx), counted with the real Qwen2.5-VL tokenizer. The tiny tokenizer
# learns its merges with this text weighted in, so every word of the prefix is one token there too and the
# same 34 tokens are dropped (tests/test_qwenimage.py checks it).
QWENIMAGE_SYSTEM = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
                    "relationships of the objects and background:")
_QWEN25VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                      "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN25VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen25vl_tokenizer(num_merges: int, system: str = QWENIMAGE_SYSTEM) -> Qwen2Tokenizer:
    """Qwen2.5-VL's layout: byte-level BPE, <|endoftext|> pad, <|im_end|> eos, the vision specials; `system`:
    the pipeline's template text, learnt whole-word so its dropped prefix has the real tokenizer's length."""
    backend = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}, merges=[]).backend_tokenizer
    lines = corpus() + [system, "system", "user", "assistant"] * 40  # role names start a line
    words = Counter(piece for line in lines
                    for piece, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(line)))
    merges = learn_bpe(words, num_merges, suffix="")
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in merges] + _QWEN25VL_SPECIALS
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768, padding_side="right",
                               eos_token="<|im_end|>", additional_special_tokens=_QWEN25VL_SPECIALS[1:])
    tokenizer.chat_template = QWEN25VL_CHAT_TEMPLATE
    return tokenizer


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

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN25VL_SPECIALS}
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


FLUX2_ARCH: dict = {
    # Flux2Transformer2DModel (FLUX.2 [klein] layout: no guidance embedding); joint_attention_dim = 3 x
    # qwen_hidden_size (the pipeline stacks Qwen3's hidden states 9, 18 and 27); axes_dims_rope: 4 axes
    # (T, H, W, L) summing to attention_head_dim
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "axes_dims_rope": (4, 4, 4, 4),
    # AutoencoderKLFlux2: 4 blocks -> /8 as the real one, then 2x2 patches normalised by its batch norm
    "latent_channels": 4, "vae_block_out_channels": (8, 16, 16, 16), "vae_layers_per_block": 1,
    "vae_norm_num_groups": 8,
    # Qwen3ForCausalLM: 28 layers, because the pipeline reads hidden states 9, 18 and 27 (Qwen3-4B has 36)
    "qwen_hidden_size": 16, "qwen_layers": 28, "qwen_heads": 2, "qwen_kv_heads": 1, "qwen_head_dim": 8,
    "qwen_intermediate_size": 16, "qwen_num_merges": 300,
}


def flux2_image_parts(a: dict, seeded, joint_attention_dim: int, guidance_embeds: bool):
    """The FLUX.2 transformer (seed slot 0), AutoencoderKLFlux2 (slot 1) and scheduler, shared by [klein] and
    [dev]: they differ in the text encoder, its width (joint_attention_dim) and the guidance embedding."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    transformer = seeded(0, lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * a["latent_channels"], num_layers=a["num_layers"],
        num_single_layers=a["num_single_layers"], attention_head_dim=a["attention_head_dim"],
        num_attention_heads=a["num_attention_heads"], joint_attention_dim=joint_attention_dim,
        timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=tuple(a["axes_dims_rope"]), rope_theta=2000,
        guidance_embeds=guidance_embeds,
    ))
    n = len(a["vae_block_out_channels"])
    vae = seeded(1, lambda: AutoencoderKLFlux2(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(a["vae_block_out_channels"]), layers_per_block=a["vae_layers_per_block"],
        norm_num_groups=a["vae_norm_num_groups"], sample_size=64, patch_size=(2, 2),
    ))
    with torch.no_grad():  # batch-norm statistics as a trained VAE has them (fresh ones are 0 / 1)
        c = vae.bn.num_features
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, c))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, c))
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2's: the pipeline passes its empirical mu
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )
    return transformer, vae, scheduler


def build_tiny_flux2(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `Flux2KleinPipeline` (FLUX.2 [klein] layout: Qwen3 text encoder) saved in
    diffusers layout under `out_dir`. Keys of `FLUX2_ARCH`. Images are multiples of 16 px; call with e.g.
    height/width 64 and `max_sequence_length=32`."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    a = resolve_arch(FLUX2_ARCH, arch)
    tokenizer = _qwen_tokenizer(a["qwen_num_merges"])
    seeded = seeder(seed, 4)
    transformer, vae, scheduler = flux2_image_parts(a, seeded, 3 * a["qwen_hidden_size"], guidance_embeds=False)
    text_encoder = seeded(2, lambda: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=a["qwen_hidden_size"], intermediate_size=a["qwen_intermediate_size"],
        num_hidden_layers=a["qwen_layers"], num_attention_heads=a["qwen_heads"],
        num_key_value_heads=a["qwen_kv_heads"], head_dim=a["qwen_head_dim"], max_position_embeddings=1024,
        rope_theta=1000000.0, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )))
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
