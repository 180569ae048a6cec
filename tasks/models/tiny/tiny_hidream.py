"""A tiny, deterministic HiDream-I1 pipeline built offline from real diffusers/transformers classes:
HiDreamImageTransformer2DModel (double- and single-stream blocks, each feed-forward a mixture of experts: a gate,
routed experts and a shared expert), the FLUX.1 AutoencoderKL, two CLIP text towers with projection (pooled), a T5
encoder and a LlamaForCausalLM whose per-layer hidden states are the text the blocks read; the Llama tokenizer is a
byte-level BPE learnt from common.py's corpus with Llama 3's special tokens (conventions: tasks/models/tiny/common.py)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, T5Config, T5EncoderModel)

from tasks.models.tiny.common import (CLIP_ARCH, VAE_ARCH, clip_tokenizer, clip_tokenizer_2, corpus, learn_bpe,
                                      make_vae, resolve_arch, seeder, t5_tokenizer)

# Llama 3's special tokens (the first the bos the post-processor prepends; <|eot_id|> the Instruct model's eos,
# which HiDreamImagePipeline also makes the pad token)
_LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama3_tokenizer(num_merges: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style pre-tokenizer, no end-of-word marker) with Llama 3's specials after it, and
    Llama 3's template: <|begin_of_text|> before every text, nothing after (the pipeline pads with the eos)."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = Counter(piece for line in corpus() for piece, _ in pre.pre_tokenize_str(line))
    merges = learn_bpe(words, num_merges, suffix="")
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in merges] + _LLAMA_SPECIALS
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer, backend.decoder = pre, decoders.ByteLevel()
    backend.add_special_tokens(_LLAMA_SPECIALS)
    bos = _LLAMA_SPECIALS[0]
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|eot_id|>",
                                   model_max_length=131072, padding_side="right")


HIDREAM_ARCH: dict = {
    # HiDreamImageTransformer2DModel: axes_dims_rope sum to attention_head_dim (the released (64, 32, 32) of 128);
    # 4 routed experts, 2 active (the released MoE); max_resolution (latent px) sets the padded length of a
    # non-square image (max_seq = its area / 4 patches) and the sampler's shift: 32 -> 256 patches, enough here
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "axes_dims_rope": (8, 4, 4), "num_routed_experts": 4, "num_activated_experts": 2, "max_resolution": (32, 32),
    **VAE_ARCH,
    # CLIP-L and CLIP-G with projection: their pooled outputs, concatenated, are text_emb_dim; 248 positions as
    # HiDream's long-context CLIPs (the pipeline pads them to min(max_sequence_length, 218))
    **CLIP_ARCH, "clip_g_hidden_size": 48,
    # T5EncoderModel (caption_channels[0]); LlamaForCausalLM (caption_channels[1]; its layers' hidden states)
    "t5_d_model": 32, "t5_d_kv": 8, "t5_d_ff": 37, "t5_layers": 2, "t5_heads": 4,
    "llama_hidden_size": 32, "llama_layers": 2, "llama_heads": 2, "llama_kv_heads": 1, "llama_intermediate_size": 37,
    "llama_num_merges": 300,
}


def _clip(a: dict, tokenizer, hidden: int) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=a["clip_intermediate_size"],
        num_hidden_layers=a["clip_layers"], num_attention_heads=a["clip_heads"], max_position_embeddings=248,
        projection_dim=hidden, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))


def build_tiny_hidream(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `HiDreamImagePipeline` saved in diffusers layout under `out_dir` (same seed -> same bytes).

    Keys of `HIDREAM_ARCH`: transformer (num_layers, num_single_layers, attention_head_dim, num_attention_heads,
    axes_dims_rope, num_routed_experts, num_activated_experts, max_resolution), VAE (latent_channels, vae_*),
    CLIPs (clip_*), T5 (t5_*), Llama (llama_*). The transformer's llama_layers follow the released pattern: block i
    reads Llama layer min(i, last). Images are multiples of 16 px; call with e.g. `max_sequence_length=32`."""
    a = resolve_arch(HIDREAM_ARCH, arch)
    tok_l, tok_g = clip_tokenizer(a["clip_num_merges"]), clip_tokenizer_2(a)
    tok_t5, tok_llama = t5_tokenizer(512), llama3_tokenizer(a["llama_num_merges"])
    seeded = seeder(seed, 6)
    blocks = a["num_layers"] + a["num_single_layers"]
    transformer = seeded(0, lambda: HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=a["latent_channels"], out_channels=a["latent_channels"],
        num_layers=a["num_layers"], num_single_layers=a["num_single_layers"],
        attention_head_dim=a["attention_head_dim"], num_attention_heads=a["num_attention_heads"],
        caption_channels=[a["t5_d_model"], a["llama_hidden_size"]],
        text_emb_dim=a["clip_hidden_size"] + a["clip_g_hidden_size"],
        num_routed_experts=a["num_routed_experts"], num_activated_experts=a["num_activated_experts"],
        axes_dims_rope=tuple(a["axes_dims_rope"]), max_resolution=tuple(a["max_resolution"]),
        llama_layers=[min(i, a["llama_layers"] - 1) for i in range(blocks)],
    ))
    vae = seeded(1, lambda: make_vae(a, scaling_factor=0.3611, shift_factor=0.1159, quant_conv=False))  # FLUX.1's
    text_encoder = seeded(2, lambda: _clip(a, tok_l, a["clip_hidden_size"]))
    text_encoder_2 = seeded(3, lambda: _clip(a, tok_g, a["clip_g_hidden_size"]))
    text_encoder_3 = seeded(4, lambda: T5EncoderModel(T5Config(
        vocab_size=len(tok_t5), d_model=a["t5_d_model"], d_kv=a["t5_d_kv"], d_ff=a["t5_d_ff"],
        num_layers=a["t5_layers"], num_heads=a["t5_heads"], feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)))
    text_encoder_4 = seeded(5, lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok_llama), hidden_size=a["llama_hidden_size"], intermediate_size=a["llama_intermediate_size"],
        num_hidden_layers=a["llama_layers"], num_attention_heads=a["llama_heads"],
        num_key_value_heads=a["llama_kv_heads"], max_position_embeddings=1024, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok_llama.bos_token_id,
        eos_token_id=tok_llama.eos_token_id)))
    # ai-toolkit's HiDream scheduler_config (shift 3.0, static); the pipeline passes mu, used only when dynamic
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = HiDreamImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok_l, text_encoder_2=text_encoder_2,
        tokenizer_2=tok_g, text_encoder_3=text_encoder_3, tokenizer_3=tok_t5, text_encoder_4=text_encoder_4,
        tokenizer_4=tok_llama, transformer=transformer)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# The learning check's settings (bench/learns.py; bench/learns_settings.py gathers every family's): the tiny model's
# width (model.arch) and the run that memorises one image, each choice's measured reason beside it.
# tiny_chroma's settings (8 heads: 128 wide, rank 16, 300 steps at lr 1e-3), taken first as the closest double/single
# block model: ratio 0.015 for the diffusers file and the kohya file (merged as ComfyUI), 297 s on 2 shared cores; a
# misnamed block (refused by diffusers, 1.000 merged) and a halved scale (0.323) stay above the 0.2 bound
# (bench.learns --only tiny_hidream --images none, 2026-11-29). Nothing left to tune.
LEARNS = {"tiny_hidream": {"arch": {"num_attention_heads": 8}, "rank": 16, "steps": 300, "lr": 1e-3}}
