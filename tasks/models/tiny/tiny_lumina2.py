"""A tiny, deterministic Lumina Image 2.0 pipeline (`Lumina2Pipeline`) built offline from real diffusers/transformers
classes: Lumina2Transformer2DModel (NextDiT: context and noise refiners, then joint blocks over caption and 2x2 image
patches, GQA attention), the FLUX.1 AutoencoderKL (scale 0.3611, shift 0.1159), a Gemma2Model text encoder and a
Gemma tokenizer (conventions: tasks/models/tiny/common.py).

The tokenizer is tiny_ltx2's Gemma layout (specials first, <pad> 0, <eos> 1, <bos> 2; byte fallback; "▁" word prefix),
its merges learnt on common.py's corpus plus the pipeline's system prompt, which Lumina2Pipeline prepends to every
caption: without it the prompt alone takes ~100 character tokens (measured), with it ~30, so the tiny model's text
window stays short. Padding on the right, as the pipeline sets it."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
from transformers import Gemma2Config, Gemma2Model, GemmaTokenizer

from tasks.models.tiny.common import VAE_ARCH, corpus, learn_bpe, make_vae, resolve_arch, seeder
from tasks.models.tiny.tiny_ltx2 import GEMMA3_CHAT_TEMPLATE, GEMMA_SPECIALS

# Lumina2Pipeline.system_prompt (diffusers 0.42.1, pipeline_lumina2.py __init__) and encode_prompt's separator
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                 "alignment based on textual prompts or user prompts. <Prompt Start> ")

LUMINA2_ARCH: dict = {
    # Lumina2Transformer2DModel: head_dim = hidden_size / heads; axes_dim_rope sums to head_dim; cap_feat_dim is
    # the Gemma width; multiple_of rounds the SwiGLU width (256 would make the tiny FFN 256 wide)
    "hidden_size": 32, "num_layers": 1, "num_refiner_layers": 1, "num_attention_heads": 2, "num_kv_heads": 1,
    "axes_dim_rope": (4, 6, 6), "multiple_of": 16,
    **VAE_ARCH,
    # Gemma2Model (the pipeline reads the hidden states before the last layer: layers >= 2)
    "gemma_hidden_size": 32, "gemma_layers": 2, "gemma_heads": 2, "gemma_kv_heads": 1, "gemma_head_dim": 16,
    "gemma_intermediate_size": 37, "gemma_num_merges": 400,
}


def lumina2_tokenizer(num_merges: int) -> GemmaTokenizer:
    """tiny_ltx2.gemma_tokenizer's layout, learnt on the corpus and (weighted 20x) the system prompt."""
    words = Counter()
    for line in corpus() + [SYSTEM_PROMPT.strip()] * 20:
        parts = line.split(" ")
        words.update([parts[0]] + ["\u2581" + w for w in parts[1:]])
    merges = learn_bpe(words, num_merges, suffix="")
    chars = sorted({c for w in words for c in w})
    tokens = GEMMA_SPECIALS + [f"<0x{i:02X}>" for i in range(256)] + chars + ["".join(m) for m in merges]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=8192, padding_side="right",
                               add_bos_token=True, additional_special_tokens=GEMMA_SPECIALS[5:])
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


def gemma2_encoder(a: dict, tokenizer) -> Gemma2Model:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>", "<bos>")}
    return Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=a["gemma_hidden_size"], intermediate_size=a["gemma_intermediate_size"],
        num_hidden_layers=a["gemma_layers"], num_attention_heads=a["gemma_heads"],
        num_key_value_heads=a["gemma_kv_heads"], head_dim=a["gemma_head_dim"],
        query_pre_attn_scalar=a["gemma_head_dim"], max_position_embeddings=1024,
        # Gemma 2's interleaving (sliding, then global) and soft-capping as gemma-2-2b's config
        layer_types=["sliding_attention", "full_attention"] * (a["gemma_layers"] // 2)
        + ["sliding_attention"] * (a["gemma_layers"] % 2),
        pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"],
    ))


def build_tiny_lumina2(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `Lumina2Pipeline` saved in diffusers layout under `out_dir` (same seed -> the same bytes).

    Keys of `LUMINA2_ARCH`: transformer (hidden_size, num_layers, num_refiner_layers, num_attention_heads,
    num_kv_heads, axes_dim_rope, multiple_of), VAE (latent_channels, vae_*: /8 like FLUX.1's), Gemma2Model (gemma_*).
    Images are multiples of 16 px (VAE /8, then 2x2 patches); call with e.g. height/width 64 and
    `max_sequence_length=64` (the system prompt takes ~30 tokens)."""
    a = resolve_arch(LUMINA2_ARCH, arch)
    tokenizer = lumina2_tokenizer(a["gemma_num_merges"])
    seeded = seeder(seed, 3)
    transformer = seeded(0, lambda: Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=a["latent_channels"], hidden_size=a["hidden_size"],
        num_layers=a["num_layers"], num_refiner_layers=a["num_refiner_layers"],
        num_attention_heads=a["num_attention_heads"], num_kv_heads=a["num_kv_heads"], multiple_of=a["multiple_of"],
        axes_dim_rope=tuple(a["axes_dim_rope"]), axes_lens=(300, 512, 512), cap_feat_dim=a["gemma_hidden_size"],
    ))
    # the FLUX.1 VAE's scale and shift (Lumina-Image-2.0's vae/config.json is FLUX.1's), no quant convs
    vae = seeded(1, lambda: make_vae(a, scaling_factor=0.3611, shift_factor=0.1159, quant_conv=False))
    text_encoder = seeded(2, lambda: gemma2_encoder(a, tokenizer))
    # Lumina-Image-2.0's scheduler_config.json: static shift 6.0 (the pipeline passes mu, unused without dynamic
    # shifting)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)
    pipe = Lumina2Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                           tokenizer=tokenizer)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# The learning check's settings (bench/learns.py; bench/learns_settings.py gathers every family's): the tiny model's
# width (model.arch) and the run that memorises one image, each choice's measured reason beside it. Z-Image's width
# (64 wide, 4 heads, here 2 KV heads for GQA, 2 joint layers), rank 16, 300 steps (bench.learns --only tiny_lumina2,
# 2026-11-29, 2 shared cores): at lr 3e-3 the files reach 0.026 but a misnamed block (0.096) and a halved scale
# (0.059) pass too, at 1e-3 0.034 (0.146, 0.137: still not caught; the modulation LoRAs make the memorising easy);
# at 3e-4 the mutations are caught (0.344, 0.498) but the files stop at 0.201, just over the 0.2 bound; at 5e-4 both
# files reach 0.073 (56 s) and a halved scale is caught (0.283), a misnamed block only just not (0.198)
LEARNS = {"tiny_lumina2": {"arch": {"hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
                                    "num_layers": 2}, "rank": 16, "steps": 300, "lr": 5e-4}}
