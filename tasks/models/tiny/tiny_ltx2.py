"""A tiny, deterministic LTX-2 pipeline (`LTX2Pipeline`, the Lightricks/LTX-2 layout) built offline from the real
diffusers/transformers classes: LTX2VideoTransformer3DModel (the audio-video transformer: a video and an audio
stream with cross-modal attention), AutoencoderKLLTX2Video, AutoencoderKLLTX2Audio, LTX2Vocoder, a
Gemma3ForConditionalGeneration text encoder (a Gemma 3 text model and a one-layer SigLIP tower the pipeline never
runs), LTX2TextConnectors (the feature projection of Gemma's stacked hidden states and the video/audio connector
transformers with their learnable registers) and the non-distilled LTX-2 scheduler.

Conventions of common.py: weights depend only on `seed` (same seed -> byte-identical
files), one seed per component, the caller's global RNG is untouched, `arch` overrides keys of `LTX2_ARCH`
(unknown key -> ValueError).

The video VAE keeps LTX-2's geometry, so the adapter's rules are the real ones: patch 4 then four downsamplings
("spatial", "temporal", "spatiotemporal", "spatiotemporal") -> 32x in space and 8x in time, a causal first frame:
clips of 1 + 8k frames become 1 + k latent frames, images are one frame; width and height are multiples of 32.
`spatial_compression_ratio=32, temporal_compression_ratio=8` are set explicitly, as in diffusers'
scripts/convert_ltx2_to_diffusers.py (the VAE's default formula counts every scaling block in both). The other
sizes follow diffusers' own LTX-2 fast tests (tests/pipelines/ltx2/testing_utils.py: transformer, audio VAE,
vocoder), with LTX-2.0's switches from the conversion script ("split" RoPE in double precision, registers in the
connectors, the scheduler's dynamic shift 0.95..2.05 with shift_terminal 0.1).

The tokenizer is a `GemmaTokenizer` (BPE with byte fallback, spaces as "▁", Gemma's special ids: <pad> 0, <eos> 1,
<bos> 2, <unk> 3, <mask> 4; <bos> leads every text, padding on the left) whose merges are learnt deterministically
from common.py's corpus, as the other tiny tokenizers are (no download)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from tasks.models.tiny.common import corpus, learn_bpe
from tasks.models.tiny.common import resolve_arch, seeder

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# Gemma 3's chat template for what transformers' chat helpers render (LTX2Pipeline.encode_prompt does not use it)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (message['content'] if message['content'] is string else "
    "message['content'] | map(attribute='text') | join('')) | trim + '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)

LTX2_ARCH: dict = {
    # "2.0" builds here; "2.3" / "2.5" build those versions' layouts (tiny_ltx2_versions.py)
    "version": "2.0",
    # LTX2VideoTransformer3DModel (diffusers' fast-test sizes): video inner dim = heads x head dim = its
    # cross_attention_dim; audio likewise; caption_channels = the Gemma width
    "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8,
    "audio_num_attention_heads": 2, "audio_attention_head_dim": 4,
    # AutoencoderKLLTX2Video: LTX-2's block types and compression (32x space, 8x time), few channels
    "latent_channels": 8, "vae_block_out_channels": (4, 8, 16, 32), "vae_decoder_block_out_channels": (8, 16, 32),
    # AutoencoderKLLTX2Audio + LTX2Vocoder (diffusers' fast-test sizes)
    "audio_latent_channels": 2, "audio_mel_bins": 8,
    # Gemma3ForConditionalGeneration's text model; the connectors read all num_layers + 1 hidden states
    "gemma_hidden_size": 32, "gemma_layers": 2, "gemma_heads": 2, "gemma_kv_heads": 1, "gemma_head_dim": 16,
    "gemma_intermediate_size": 37, "gemma_num_merges": 300,
    # LTX2TextConnectors: heads x head dim = the Gemma width; the text length must be a multiple of the registers
    "connector_heads": 4, "connector_head_dim": 8, "connector_layers": 1, "connector_registers": 8,
}


def gemma_tokenizer(num_merges: int):
    """Gemma's tokenizer class and layout: specials first, the 256 byte-fallback tokens, the corpus' characters,
    then merges learnt on its words with Gemma's "▁" word prefix (spaces are replaced, never split on)."""
    from transformers import GemmaTokenizer

    words = Counter()
    for line in corpus():
        parts = line.split(" ")
        words.update([parts[0]] + ["\u2581" + w for w in parts[1:]])
    merges = learn_bpe(words, num_merges, suffix="")
    chars = sorted({c for w in words for c in w})
    tokens = GEMMA_SPECIALS + [f"<0x{i:02X}>" for i in range(256)] + chars + ["".join(m) for m in merges]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=131072, padding_side="left",
                               add_bos_token=True, additional_special_tokens=GEMMA_SPECIALS[5:])
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


def gemma3_encoder(a: dict, tokenizer):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA_SPECIALS}
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=a["gemma_hidden_size"],
                         intermediate_size=a["gemma_intermediate_size"], num_hidden_layers=a["gemma_layers"],
                         num_attention_heads=a["gemma_heads"], num_key_value_heads=a["gemma_kv_heads"],
                         head_dim=a["gemma_head_dim"], query_pre_attn_scalar=a["gemma_head_dim"],
                         max_position_embeddings=2048, sliding_window=16,
                         # Gemma 3's interleaving: sliding-window layers, then a global one
                         layer_types=["sliding_attention"] * (a["gemma_layers"] - 1) + ["full_attention"],
                         pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"]),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=16,
                           num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    ))


def _video_vae(a: dict):
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        block_out_channels=tuple(a["vae_block_out_channels"]),
        decoder_block_out_channels=tuple(a["vae_decoder_block_out_channels"]),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=False,
        patch_size=4, patch_size_t=1, scaling_factor=1.0, encoder_causal=True, decoder_causal=False,
        encoder_spatial_padding_mode="zeros", decoder_spatial_padding_mode="reflect",
        spatial_compression_ratio=32, temporal_compression_ratio=8,
    )
    with torch.no_grad():  # per-channel statistics as a trained VAE has them (fresh ones are 0 / 1)
        c = a["latent_channels"]
        vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, c))
        vae.latents_std.copy_(torch.linspace(0.5, 2.0, c))
    return vae


def audio_parts(a: dict, seeded) -> tuple:
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    audio_vae = seeded(3, lambda: AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=a["audio_latent_channels"], norm_type="pixel", causality_axis="height",
        dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
        mel_bins=a["audio_mel_bins"]))
    vocoder = seeded(4, lambda: LTX2Vocoder(
        in_channels=2 * a["audio_mel_bins"], hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000))
    return audio_vae, vocoder


def build_tiny_ltx2(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `LTX2Pipeline` (Lightricks/LTX-2 layout; arch["version"] "2.3" / "2.5": those versions'
    layouts, tiny_ltx2_versions.py) saved in diffusers layout under `out_dir`.
    Clips are 1 + 8k frames, sizes multiples of 32 and at least 64 (the decoder pads by reflection); call with e.g.
    height/width 64, num_frames 9 and `max_sequence_length=32` (a multiple of the connectors' 8 registers)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    if str((arch or {}).get("version", "2.0")) != "2.0":  # LTX-2.3 / 2.5: tiny_ltx2_versions.build_tiny_ltx2
        raise ValueError(f"arch version={arch['version']!r}: build_tiny_ltx2 builds LTX-2.0; the registry's "
                         "tiny_ltx2_versions.build_tiny_ltx2 builds every version")
    a = resolve_arch(LTX2_ARCH, arch)
    tokenizer = gemma_tokenizer(a["gemma_num_merges"])
    seeded = seeder(seed, 6)
    audio_vae, vocoder = audio_parts(a, seeded)
    inner = a["num_attention_heads"] * a["attention_head_dim"]
    audio_inner = a["audio_num_attention_heads"] * a["audio_attention_head_dim"]
    latent_mel_bins = a["audio_mel_bins"] // audio_vae.mel_compression_ratio
    transformer = seeded(0, lambda: LTX2VideoTransformer3DModel(
        in_channels=a["latent_channels"], out_channels=a["latent_channels"], patch_size=1, patch_size_t=1,
        num_attention_heads=a["num_attention_heads"], attention_head_dim=a["attention_head_dim"],
        cross_attention_dim=inner, vae_scale_factors=(8, 32, 32),
        audio_in_channels=a["audio_latent_channels"] * latent_mel_bins,
        audio_out_channels=a["audio_latent_channels"] * latent_mel_bins,
        audio_num_attention_heads=a["audio_num_attention_heads"],
        audio_attention_head_dim=a["audio_attention_head_dim"], audio_cross_attention_dim=audio_inner,
        audio_sampling_rate=16000, audio_hop_length=160, num_layers=a["num_layers"],
        qk_norm="rms_norm_across_heads", caption_channels=a["gemma_hidden_size"], rope_type="split",
        rope_double_precision=True, timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000,
    ))
    vae = seeded(1, lambda: _video_vae(a))
    text_encoder = seeded(2, lambda: gemma3_encoder(a, tokenizer))
    connectors = seeded(5, lambda: LTX2TextConnectors(
        caption_channels=a["gemma_hidden_size"], text_proj_in_factor=a["gemma_layers"] + 1,
        video_connector_num_attention_heads=a["connector_heads"],
        video_connector_attention_head_dim=a["connector_head_dim"], video_connector_num_layers=a["connector_layers"],
        video_connector_num_learnable_registers=a["connector_registers"],
        audio_connector_num_attention_heads=a["connector_heads"],
        audio_connector_attention_head_dim=a["connector_head_dim"], audio_connector_num_layers=a["connector_layers"],
        audio_connector_num_learnable_registers=a["connector_registers"], connector_rope_base_seq_len=4096,
        rope_theta=10000.0, rope_double_precision=True, causal_temporal_positioning=False, rope_type="split",
        per_modality_projections=False, proj_bias=False,
    ))
    scheduler = FlowMatchEulerDiscreteScheduler(  # Lightricks/LTX-2's (non-distilled) scheduler
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    pipe = LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# LTX-2's video stream: the clip (9 frames = 1 + 8k, 2 latent frames of 2x2 at 64 px), ltx-trainer's targets
LEARNS = {"tiny_ltx2": {"arch": {}, "rank": 16, "steps": 1200, "lr": 1e-2, "clip": True}}
