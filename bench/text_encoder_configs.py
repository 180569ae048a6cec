"""The text (and image) encoders of the full-size models, as their published config.json files give them: what the
benchmarks build on the meta device to count a real encoder's bytes and run its forward on fake tensors
(bench.memory's node rows; bench.load's text rows). Values are the checkpoints' own (the pipeline folder's
text_encoder*/config.json, or the model repository it copies); only the keys that shape the model are kept.

    from bench.text_encoder_configs import NAMES, config, model_class, build
    build("t5_xxl")   # T5EncoderModel on the meta device, 4.76 B parameters

Who uses which (diffusers' pipeline folders):
- clip_l: FLUX.1 `text_encoder`, SD3 `text_encoder` (with projection), SDXL `text_encoder` (openai/clip-vit-large-patch14)
- clip_g: SD3 / SDXL `text_encoder_2` (laion CLIP-ViT-bigG-14, with projection)
- t5_xxl: FLUX.1 `text_encoder_2`, SD3 `text_encoder_3` (google/t5-v1_1-xxl's encoder)
- umt5_xxl: Wan 2.1 / 2.2 `text_encoder` (google/umt5-xxl's encoder)
- mistral_small_3_1: FLUX.2 [dev] `text_encoder` (mistralai/Mistral-Small-3.1-24B-Instruct-2503, vision tower included)
- qwen2_5_vl_7b: Qwen-Image `text_encoder` (Qwen/Qwen2.5-VL-7B-Instruct); HunyuanVideo 1.5 holds its text model alone
- gemma3_12b: LTX-2 `text_encoder` (google/gemma-3-12b-it, vision tower included)
- qwen3_4b: Z-Image `text_encoder` (Qwen3Model), FLUX.2 [klein] 4B (Qwen3ForCausalLM) (Qwen/Qwen3-4B)
- qwen3_8b: FLUX.2 [klein] 9B `text_encoder` (Qwen/Qwen3-8B)
- byt5_small: HunyuanVideo 1.5 `text_encoder_2` (Glyph-SDXL-v2's byt5-small)
- clip_vit_h: Wan 2.1 I2V `image_encoder` (laion CLIP-ViT-H-14's vision tower; cached with each clip's condition)"""
from __future__ import annotations

# (transformers config class, model class, the config.json values)
_CONFIGS = {
    "clip_l": ("CLIPTextConfig", "CLIPTextModel", dict(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=2, pad_token_id=1)),
    "clip_g": ("CLIPTextConfig", "CLIPTextModelWithProjection", dict(
        vocab_size=49408, hidden_size=1280, intermediate_size=5120, projection_dim=1280, num_hidden_layers=32,
        num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=2, pad_token_id=1)),
    "t5_xxl": ("T5Config", "T5EncoderModel", dict(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_decoder_layers=24, num_heads=64,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6, tie_word_embeddings=False, dropout_rate=0.1)),
    "umt5_xxl": ("UMT5Config", "UMT5EncoderModel", dict(
        vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_decoder_layers=24, num_heads=64,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6, tie_word_embeddings=False, dropout_rate=0.1)),
    "mistral_small_3_1": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
        text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                         num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000000.0,
                         sliding_window=None, hidden_act="silu"),
        vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                           num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14, num_channels=3,
                           rope_theta=10000.0, hidden_act="silu"),
        image_token_index=10, spatial_merge_size=2, projector_hidden_act="gelu", multimodal_projector_bias=False,
        vision_feature_layer=-1, tie_word_embeddings=False)),
    "qwen2_5_vl_7b": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", dict(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, hidden_act="silu", sliding_window=32768, max_window_layers=28,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]},
                         bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3,
                           out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                           hidden_act="silu"),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=False)),
    "gemma3_12b": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        text_config=dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                         max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=1024,
                         hidden_activation="gelu_pytorch_tanh",
                         # sliding_window_pattern 6: five local layers, then a global one
                         layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
                         rope_scaling={"factor": 8.0, "rope_type": "linear"}, rope_theta=1000000.0,
                         rope_local_base_freq=10000.0),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_hidden_layers=27, num_attention_heads=16, image_size=896, patch_size=14,
                           vision_use_head=False),
        mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144)),
    "qwen3_4b": ("Qwen3Config", "Qwen3Model", dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        hidden_act="silu", tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)),
    "qwen3_8b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        hidden_act="silu", tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)),
    "byt5_small": ("T5Config", "T5EncoderModel", dict(
        vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_decoder_layers=4, num_heads=6,
        relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6,
        tie_word_embeddings=False)),
    "clip_vit_h": ("CLIPVisionConfig", "CLIPVisionModel", dict(
        hidden_size=1280, intermediate_size=5120, projection_dim=1024, num_hidden_layers=32, num_attention_heads=16,
        image_size=224, patch_size=14, num_channels=3, hidden_act="gelu", layer_norm_eps=1e-5)),
}
NAMES = tuple(_CONFIGS)
# Parameters, as the model cards / the Hub give them (not for byt5_small: its card counts the decoder too)
PARAMS = {"clip_l": 123.1e6, "clip_g": 694.7e6, "t5_xxl": 4.762e9, "umt5_xxl": 5.68e9, "mistral_small_3_1": 24.01e9,
          "qwen2_5_vl_7b": 8.29e9, "gemma3_12b": 12.19e9, "qwen3_4b": 4.02e9, "qwen3_8b": 8.19e9, "clip_vit_h": 632.1e6}


def _entry(name) -> tuple:
    # a name of this table, or a family's own encoder as its RealSize declares it: (config class, model class, values)
    return name if isinstance(name, tuple) else _CONFIGS[name]


def config(name: str | tuple):
    """The transformers config object of encoder `name` (one of NAMES, or a (config class, model class, values))."""
    import transformers

    cls, _, values = _entry(name)
    return getattr(transformers, cls)(**values)


def model_class(name: str | tuple) -> type:
    """The transformers model class the pipeline folder names for `name` (Z-Image's Qwen3Model; see the doc)."""
    import transformers

    return getattr(transformers, _entry(name)[1])


def build(name: str | tuple, device: str = "meta", dtype=None):
    """The encoder at its real size on `device` (meta: shapes only, no memory), in `dtype` (default bf16)."""
    import torch

    with torch.device(device):
        model = model_class(name)(config(name))
    return model.to(dtype or torch.bfloat16).eval().requires_grad_(False)
