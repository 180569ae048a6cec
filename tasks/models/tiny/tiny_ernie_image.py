"""A tiny, deterministic ERNIE-Image pipeline (`ErnieImagePipeline`: ErnieImageTransformer2DModel, the FLUX.2 VAE,
a Mistral3Model text encoder with a Ministral 3 text model) built offline from real diffusers/transformers classes.
Conventions of common.py: weights depend only on `seed`, the caller's RNG is untouched, `arch` overrides keys of
`ERNIE_IMAGE_ARCH`.

The tokenizer is tiny_flux2_dev's Mistral-layout byte-level BPE (Tekken's special ids), with a <s> prepended as
the real tokenizer does for `add_special_tokens=True` (the pipeline tokenizes the bare caption, no chat template).
ErnieImageTransformer2DModel zero-initialises its adaLN modulation and final projection (a fresh model's output is
0 and every block's gate is 0, so no LoRA gradient flows): the tiny model gives them a Linear's default init, as
a trained model has them non-zero."""
from __future__ import annotations

from pathlib import Path

from tokenizers import processors

from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_flux2_dev import mistral_tokenizer

ERNIE_IMAGE_ARCH: dict = {
    # ErnieImageTransformer2DModel: head_dim = hidden_size / heads; rope_axes_dim sums to head_dim (the real
    # (32, 48, 48) for 128); in_channels = 4 x latent_channels (2x2 patches); text_in_dim = mistral_hidden_size
    "hidden_size": 32, "num_attention_heads": 2, "num_layers": 2, "ffn_hidden_size": 64, "rope_axes_dim": (4, 6, 6),
    # AutoencoderKLFlux2: 4 blocks -> /8 as the real one (the pipeline's vae_scale_factor 2**4 = 16 with patches)
    "latent_channels": 4, "vae_block_out_channels": (8, 16, 16, 16), "vae_layers_per_block": 1,
    "vae_norm_num_groups": 8,
    # Mistral3Model's Ministral 3 text model (the pipeline reads hidden_states[-2]: layers >= 2)
    "mistral_hidden_size": 16, "mistral_layers": 2, "mistral_heads": 2, "mistral_kv_heads": 1,
    "mistral_head_dim": 8, "mistral_intermediate_size": 16, "mistral_num_merges": 400,
}


def ernie_tokenizer(num_merges: int):
    tokenizer = mistral_tokenizer(num_merges)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    tokenizer.chat_template = None  # ErnieImagePipeline renders none
    return tokenizer


def build_tiny_ernie_image(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `ErnieImagePipeline` saved in diffusers layout under `out_dir` (no prompt enhancer).
    Images are multiples of 16 px; call with e.g. height/width 64 and `max_sequence_length=32`."""
    import torch
    from diffusers import (AutoencoderKLFlux2, ErnieImagePipeline, ErnieImageTransformer2DModel,
                           FlowMatchEulerDiscreteScheduler)
    from transformers import Mistral3Config, Mistral3Model

    a = resolve_arch(ERNIE_IMAGE_ARCH, arch)
    tokenizer = ernie_tokenizer(a["mistral_num_merges"])
    seeded = seeder(seed, 3)

    def transformer_():
        t = ErnieImageTransformer2DModel(
            hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"], num_layers=a["num_layers"],
            ffn_hidden_size=a["ffn_hidden_size"], in_channels=4 * a["latent_channels"],
            out_channels=4 * a["latent_channels"], patch_size=1, text_in_dim=a["mistral_hidden_size"],
            rope_theta=256, rope_axes_dim=tuple(a["rope_axes_dim"]), eps=1e-6, qk_layernorm=True)
        t.adaLN_modulation[-1].reset_parameters()  # zero in the class: see the module docstring
        t.final_linear.reset_parameters()
        return t

    transformer = seeded(0, transformer_)
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
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    text_encoder = seeded(2, lambda: Mistral3Model(Mistral3Config(
        # ERNIE-Image's text_encoder/config.json layout (musubi-tuner's ernie_image_utils.py quotes it): a
        # Ministral 3 text model (yarn RoPE at its values) and a Pixtral vision tower the pipeline never runs
        text_config=dict(model_type="ministral3", vocab_size=len(tokenizer), hidden_size=a["mistral_hidden_size"],
                         intermediate_size=a["mistral_intermediate_size"], num_hidden_layers=a["mistral_layers"],
                         num_attention_heads=a["mistral_heads"], num_key_value_heads=a["mistral_kv_heads"],
                         head_dim=a["mistral_head_dim"], max_position_embeddings=262144, rms_norm_eps=1e-5,
                         sliding_window=None, tie_word_embeddings=True, **ids),
        vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=16, image_size=32, patch_size=8, num_channels=3, head_dim=8),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        tie_word_embeddings=True, **ids,
    )))
    # static shift 4.0: the official scheduler_config.json's, as musubi-tuner's ernie_image_generate_image.py
    # (--flow_shift help) quotes it; the pipeline passes its own linear sigmas, which the shift then bends
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=4.0, use_dynamic_shifting=False)
    pipe = ErnieImagePipeline(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              scheduler=scheduler)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# Z-Image's width and lr (also one single-stream DiT, 4 heads of 16): measured ratio 0.146 on both files (diffusers
# through load_lora_weights, kohya merged as ComfyUI does) in 98 s; the mutations stay above the bound (misnamed
# block 0.42, halved scale 0.45). lr 1e-2 (FLUX.2's) was not measured: the lock's queue outlasted this session.
LEARNS = {"tiny_ernie_image": {"arch": {"hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
                                        "rope_axes_dim": (4, 6, 6)},
                               "rank": 16, "steps": 300, "lr": 3e-3}}
