"""Tiny, deterministic LTX-2.3 and LTX-2.5 pipelines (`LTX2Pipeline`, as diffusers lays those checkpoints out), built
offline from the real diffusers/transformers classes with each version's switches. `build_tiny_ltx2(out_dir, seed,
{"version": "2.3"})` (or "2.5") lands here, so `model.family: ltx2` builds them with no registry entry of their own;
`build_tiny_ltx23` / `build_tiny_ltx25` are the same with the version fixed.

What differs from the LTX-2.0 tiny model (tiny_ltx2.py), after diffusers' LTX-2 conversion presets (the 2.0 / 2.3 / 2.5
`get_ltx2_*_config` helpers) and the classes' own docs:
- Transformer: gated attention and cross-attention modulation in both streams (`gated_attn`, `cross_attn_mod`,
  9 modulation parameters a block, the timestep-dependent `prompt_adaln` over the text keys/values), no caption
  projection (`use_prompt_embeddings=False`: the connectors project per modality), perturbed attention (STG). 2.5
  adds `ff_bias=False` (video feed-forward without bias) and `use_keyframes_abs_pos_embedding=True` (zero-initialised,
  read only by the DFR keyframe pipelines); `prompt_adaln_single` (arch) sets `use_prompt_adaln_single`, which the
  2.5 preset keeps True and the transformer's docs call False for 2.5's KV-cacheable cross-attention.
- Connectors: per-modality projections (`per_modality_projections=True`, biased) to the video and audio streams' own
  widths (the transformer's heads x head dims), gated attention; as many registers as the 2.0 tiny model.
- Text encoder: Gemma 3 (2.3, as 2.0) or a Gemma 4 text model, `Gemma4UnifiedForConditionalGeneration` without
  vision or audio embedders (2.5); its hidden size and layers + 1 size the connectors' projection, as diffusers'
  2.5 preset derives them. The tokenizer is tiny_ltx2's GemmaTokenizer (left padding, <bos> first).
- Video VAE: 2.3's block layout (also 2.5's: "byte-identical" in the preset): four up blocks
  (spatiotemporal, spatiotemporal, temporal, spatial; factors 2, 2, 1, 2; no residual upsampling), zero padding in
  the decoder; still 32x in space and 8x in time with a causal first frame, per-channel latent statistics.
- Vocoder: `LTX2VocoderWithBWE` (a vocoder then a bandwidth extender to 48 kHz), tiny.
- 2.5 also ships `duration_head` (`LTX2DurationHead`, which predicts num_frames when a caller omits it); the
  diffusion video decoder and the Gemma 4 prompt enhancer of the real checkpoint are left out (LTX2Pipeline's
  `__call__` decodes with `vae` and never enhances unless asked).

Same conventions as common.py: weights depend only on `seed`, one seed per component, the caller's global RNG is
untouched, `arch` overrides keys of `LTX2_VERSION_ARCH` (unknown key -> ValueError)."""
from __future__ import annotations

from pathlib import Path

import torch

from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_ltx2 import LEARNS  # noqa: F401 (the registry's builder module: bench/learns_settings.py)
from tasks.models.tiny.tiny_ltx2 import build_tiny_ltx2 as build_tiny_ltx2_0
from tasks.models.tiny.tiny_ltx2 import GEMMA_SPECIALS, LTX2_ARCH, audio_parts, gemma3_encoder, gemma_tokenizer

VERSIONS = ("2.3", "2.5")
LTX2_VERSION_ARCH: dict = {
    **{k: v for k, v in LTX2_ARCH.items() if k not in ("connector_heads", "connector_head_dim")},  # derived here
    "version": "2.3",
    # 2.3's VAE: encoder (256, 512, 1024, 1024), decoder (256, 512, 512, 1024), scaled down
    "vae_block_out_channels": (4, 8, 16, 16), "vae_decoder_block_out_channels": (8, 16, 16, 32),
    "prompt_adaln_single": True,  # use_prompt_adaln_single (diffusers' 2.5 preset keeps the default)
}


def _gemma4(a: dict, tokenizer):
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA_SPECIALS}
    return Gemma4UnifiedForConditionalGeneration(Gemma4UnifiedConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=a["gemma_hidden_size"],
                         intermediate_size=a["gemma_intermediate_size"], num_hidden_layers=a["gemma_layers"],
                         num_attention_heads=a["gemma_heads"], num_key_value_heads=a["gemma_kv_heads"],
                         head_dim=a["gemma_head_dim"], global_head_dim=a["gemma_head_dim"],
                         max_position_embeddings=2048, sliding_window=16,
                         layer_types=["sliding_attention"] * (a["gemma_layers"] - 1) + ["full_attention"],
                         pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"]),
        vision_config=None, audio_config=None,  # text only: LTX2Pipeline.encode_prompt reads its hidden states
    ))


def _video_vae(a: dict):
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        block_out_channels=tuple(a["vae_block_out_channels"]),
        decoder_block_out_channels=tuple(a["vae_decoder_block_out_channels"]),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True, True),
        decoder_inject_noise=(False, False, False, False, False),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
        upsample_residual=(False, False, False, False), upsample_factor=(2, 2, 1, 2), timestep_conditioning=False,
        patch_size=4, patch_size_t=1, scaling_factor=1.0, encoder_causal=True, decoder_causal=False,
        encoder_spatial_padding_mode="zeros", decoder_spatial_padding_mode="zeros",
        spatial_compression_ratio=32, temporal_compression_ratio=8,
    )
    with torch.no_grad():  # per-channel statistics as a trained VAE has them
        c = a["latent_channels"]
        vae.latents_mean.copy_(torch.linspace(0.3, -0.3, c))
        vae.latents_std.copy_(torch.linspace(0.6, 1.8, c))
    return vae


def _vocoder_bwe(a: dict):
    # stage 1 at the audio VAE's 16 kHz, then the bandwidth extender to 48 kHz: its upsampling (3 x 2 x 2 = 12) is
    # 3 (48 / 16 kHz) x its mel hop (4), so the residual and the resampled waveform line up, as 240 = 3 x 80 in 2.3
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    mel = a["audio_mel_bins"]
    return LTX2VocoderWithBWE(
        in_channels=2 * mel, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], act_fn="snakebeta", antialias=True,
        antialias_ratio=2, antialias_kernel_size=12, final_act_fn=None, final_bias=False,
        bwe_in_channels=2 * mel, bwe_hidden_channels=16, bwe_out_channels=2, bwe_upsample_kernel_sizes=[7, 4, 4],
        bwe_upsample_factors=[3, 2, 2], bwe_resnet_kernel_sizes=[3], bwe_resnet_dilations=[[1, 3, 5]],
        bwe_act_fn="snakebeta", bwe_antialias=True, bwe_antialias_ratio=2, bwe_antialias_kernel_size=12,
        bwe_final_act_fn=None, bwe_final_bias=False, filter_length=16, hop_length=4, window_length=16,
        num_mel_channels=mel, input_sampling_rate=16000, output_sampling_rate=48000)


def build_tiny_ltx2(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """The registry's tiny LTX-2 builder: model.arch.version 2.0 (the default: tiny_ltx2.build_tiny_ltx2), 2.3 or 2.5."""
    if str((arch or {}).get("version", "2.0")) == "2.0":
        return build_tiny_ltx2_0(out_dir, seed, {k: v for k, v in (arch or {}).items() if k != "version"})
    return build_tiny_ltx2_version(out_dir, seed, arch)


def build_tiny_ltx2_version(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight LTX-2.3 / LTX-2.5 `LTX2Pipeline` (arch["version"]) saved in diffusers layout under
    `out_dir`. Clips 1 + 8k frames, sides multiples of 32; `max_sequence_length` a multiple of 8 (the registers)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.duration_head import LTX2DurationHead

    a = resolve_arch(LTX2_VERSION_ARCH, arch)
    a["version"] = str(a["version"])  # YAML reads an unquoted 2.5 as a number
    if a["version"] not in VERSIONS:
        raise ValueError(f"arch version={a['version']!r}: choose one of {VERSIONS} (2.0: tiny_ltx2.LTX2_ARCH)")
    v25 = a["version"] == "2.5"
    tokenizer = gemma_tokenizer(a["gemma_num_merges"])
    seeded = seeder(seed, 8)
    audio_vae, _ = audio_parts(a, seeded)
    vocoder = seeded(4, lambda: _vocoder_bwe(a))
    heads, head_dim = a["num_attention_heads"], a["attention_head_dim"]
    audio_heads, audio_head_dim = a["audio_num_attention_heads"], a["audio_attention_head_dim"]
    inner, audio_inner = heads * head_dim, audio_heads * audio_head_dim
    latent_mel_bins = a["audio_mel_bins"] // audio_vae.mel_compression_ratio
    transformer = seeded(0, lambda: LTX2VideoTransformer3DModel(
        in_channels=a["latent_channels"], out_channels=a["latent_channels"], patch_size=1, patch_size_t=1,
        num_attention_heads=heads, attention_head_dim=head_dim, cross_attention_dim=inner,
        vae_scale_factors=(8, 32, 32), gated_attn=True, cross_attn_mod=True,
        audio_in_channels=a["audio_latent_channels"] * latent_mel_bins,
        audio_out_channels=a["audio_latent_channels"] * latent_mel_bins, audio_num_attention_heads=audio_heads,
        audio_attention_head_dim=audio_head_dim, audio_cross_attention_dim=audio_inner, audio_sampling_rate=16000,
        audio_hop_length=160, audio_gated_attn=True, audio_cross_attn_mod=True, num_layers=a["num_layers"],
        qk_norm="rms_norm_across_heads", caption_channels=a["gemma_hidden_size"], rope_type="split",
        rope_double_precision=True, timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000,
        use_prompt_embeddings=False, perturbed_attn=True, use_prompt_adaln_single=a["prompt_adaln_single"],
        **(dict(ff_bias=False, use_keyframes_abs_pos_embedding=True) if v25 else {}),
    ))
    vae = seeded(1, lambda: _video_vae(a))
    text_encoder = seeded(2, lambda: (_gemma4 if v25 else gemma3_encoder)(a, tokenizer))
    connectors = seeded(5, lambda: LTX2TextConnectors(
        caption_channels=a["gemma_hidden_size"], text_proj_in_factor=a["gemma_layers"] + 1,
        video_connector_num_attention_heads=heads, video_connector_attention_head_dim=head_dim,
        video_connector_num_layers=a["connector_layers"],
        video_connector_num_learnable_registers=a["connector_registers"], video_gated_attn=True,
        audio_connector_num_attention_heads=audio_heads, audio_connector_attention_head_dim=audio_head_dim,
        audio_connector_num_layers=a["connector_layers"],
        audio_connector_num_learnable_registers=a["connector_registers"], audio_gated_attn=True,
        connector_rope_base_seq_len=4096, rope_theta=10000.0, rope_double_precision=True,
        causal_temporal_positioning=False, rope_type="split", per_modality_projections=True,
        video_hidden_dim=inner, audio_hidden_dim=audio_inner, proj_bias=True,
    ))
    extra = {}
    if v25:
        extra["duration_head"] = seeded(6, lambda: LTX2DurationHead(
            video_cross_attention_dim=inner, audio_cross_attention_dim=audio_inner, pooler_hidden_dim=8,
            num_queries=1, num_pooler_heads=2, mlp_hidden_dim=8))
    scheduler = FlowMatchEulerDiscreteScheduler(  # as the 2.0 tiny model (LTX-2's non-distilled scheduler)
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    pipe = LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder, **extra)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_tiny_ltx23(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    return build_tiny_ltx2_version(out_dir, seed, {**(arch or {}), "version": "2.3"})


def build_tiny_ltx25(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    return build_tiny_ltx2_version(out_dir, seed, {**(arch or {}), "version": "2.5"})
