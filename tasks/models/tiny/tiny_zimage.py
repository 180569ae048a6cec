"""A tiny, deterministic Z-Image pipeline (its text encoder a language model, Qwen3) built offline from real
diffusers/transformers classes; the tokenizer is a byte-level BPE learnt from common.py's corpus in the real tokenizer
class, with a Qwen-style chat template and special tokens (conventions: tasks/models/tiny/common.py)."""
from __future__ import annotations

from pathlib import Path

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from tasks.models.tiny.common import VAE_ARCH, corpus, qwen_bpe_tokenizer, resolve_arch, seeder


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


def qwen_tokenizer(num_merges: int, chat_template: str = QWEN3_CHAT_TEMPLATE) -> Qwen2Tokenizer:
    """Byte-level BPE with Qwen2's pre-tokenizer (GPT-2 style, no end-of-word marker), Qwen's special
    tokens (<|endoftext|> = pad/unk, <|im_start|>, <|im_end|> = eos, as Qwen3's model config) and a chat template."""
    return qwen_bpe_tokenizer(num_merges, corpus(), _QWEN_SPECIALS, chat_template)


ZIMAGE_ARCH: dict = {
    # ZImageTransformer2DModel; cap_feat_dim = qwen_hidden_size; axes_dims sum to dim / n_heads
    "dim": 32, "n_layers": 1, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "axes_dims": (4, 6, 6),
    "axes_lens": (1536, 512, 512),  # Z-Image-Turbo's
    **VAE_ARCH,
    # Qwen3Model (Z-Image reads the hidden states before the last layer: layers >= 2)
    "qwen_hidden_size": 32, "qwen_layers": 2, "qwen_heads": 2, "qwen_kv_heads": 1, "qwen_head_dim": 16,
    "qwen_intermediate_size": 37, "qwen_num_merges": 300,
}


def make_qwen3(a: dict, tokenizer) -> Qwen3Model:
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
    tokenizer = qwen_tokenizer(a["qwen_num_merges"])
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
    text_encoder = seeded(2, lambda: make_qwen3(a, tokenizer))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,  # Z-Image-Turbo's
                                                use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
LEARNS = {"tiny_zimage": {"arch": {"dim": 64, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2}, "rank": 16,
                           "steps": 300, "lr": 3e-3}}
