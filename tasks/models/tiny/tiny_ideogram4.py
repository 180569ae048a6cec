"""A tiny, deterministic Ideogram 4 pipeline built offline from real diffusers/transformers classes: two
Ideogram4Transformer2DModel (the conditional `transformer` and the `unconditional_transformer`, each its own
seed), AutoencoderKLFlux2 (/8, 2x2 patches normalised by its batch norm), a Qwen3-VL text encoder (Qwen3VLModel
with 36 language layers, because the pipeline taps layers 0, 3, ..., 33, 35) and a byte-level BPE tokenizer with
Qwen3-VL's chat template (content as a list of parts, as encode_prompt sends it). Conventions:
tasks/models/tiny/common.py."""
from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
from diffusers import Ideogram4Transformer2DModel
from transformers import Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLModel

from tasks.models.tiny.common import corpus, qwen_bpe_tokenizer, resolve_arch, seeder

# The pipeline's QWEN3_VL_ACTIVATION_LAYERS: 13 taps, stacked per token (llm_features_dim = 13 x hidden)
TAPS = 13
# Added to each block's gate biases: tanh(gate) ~0.1 at random init leaves each block a tenth of the residual stream
# (its output RMS-normed before the gate), so a LoRA on the blocks could barely move the prediction (the learning
# check's ratio stayed at 0.50-0.51 at lr 3e-3 and 1e-2); tanh(~1) ~0.76, as an open gate of a trained model
GATE_BIAS = 1.0

# Qwen3-VL's template for one user turn of text parts and the generation prompt (what encode_prompt renders)
QWEN3VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
             "<|video_pad|>"]


def qwen3vl_tokenizer(num_merges: int) -> Qwen2Tokenizer:
    lines = corpus() + ["user", "assistant"] * 40  # role names start a line
    return qwen_bpe_tokenizer(num_merges, lines, _SPECIALS, QWEN3VL_CHAT_TEMPLATE)


IDEOGRAM4_ARCH: dict = {
    # Ideogram4Transformer2DModel (both); hidden = heads x head_dim; mrope_section sums to head_dim / 2
    "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "intermediate_size": 64, "adaln_dim": 32,
    "mrope_section": (4, 2, 2),
    # AutoencoderKLFlux2: 4 blocks -> /8 as the real one; the transformer's in_channels = 4 x latent_channels
    "latent_channels": 4, "vae_block_out_channels": (8, 16, 16, 16), "vae_layers_per_block": 1,
    "vae_norm_num_groups": 8,
    # Qwen3-VL's language model: 36 layers as Qwen3-VL-8B (the taps reach layer 35); a one-block vision tower
    "qwen_hidden_size": 16, "qwen_layers": 36, "qwen_heads": 2, "qwen_kv_heads": 1, "qwen_head_dim": 8,
    "qwen_intermediate_size": 16, "qwen_num_merges": 300,
}


def make_qwen3vl(a: dict, tokenizer) -> Qwen3VLModel:
    ids = tokenizer.convert_tokens_to_ids
    return Qwen3VLModel(Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=a["qwen_hidden_size"],
                         intermediate_size=a["qwen_intermediate_size"], num_hidden_layers=a["qwen_layers"],
                         num_attention_heads=a["qwen_heads"], num_key_value_heads=a["qwen_kv_heads"],
                         head_dim=a["qwen_head_dim"], max_position_embeddings=4096, rms_norm_eps=1e-6,
                         # Qwen3-VL's interleaved MRoPE, its section scaled to the tiny head (sum = head_dim / 2)
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                         tie_word_embeddings=False),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=16,
                           out_hidden_size=a["qwen_hidden_size"], num_position_embeddings=16,
                           deepstack_visual_indexes=[]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False))


def build_tiny_ideogram4(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `Ideogram4Pipeline` saved in diffusers layout under `out_dir`. Keys of `IDEOGRAM4_ARCH`.
    Images are multiples of 16 px (VAE /8, then 2x2 patches); call with e.g. height/width 64 and
    `max_sequence_length=32`."""
    a = resolve_arch(IDEOGRAM4_ARCH, arch)
    tokenizer = qwen3vl_tokenizer(a["qwen_num_merges"])
    seeded = seeder(seed, 4)

    def transformer():
        return Ideogram4Transformer2DModel(
            in_channels=4 * a["latent_channels"], num_layers=a["num_layers"],
            attention_head_dim=a["attention_head_dim"], num_attention_heads=a["num_attention_heads"],
            intermediate_size=a["intermediate_size"], adaln_dim=a["adaln_dim"],
            llm_features_dim=TAPS * a["qwen_hidden_size"], rope_theta=5_000_000,
            mrope_section=tuple(a["mrope_section"]), norm_eps=1e-5)

    conditional, unconditional = seeded(0, transformer), seeded(3, transformer)
    with torch.no_grad():  # the blocks' tanh gates open as a trained model's are (see LEARNS below)
        for block in (*conditional.layers, *unconditional.layers):
            bias = block.adaln_modulation.bias.view(4, -1)  # scale_msa, gate_msa, scale_mlp, gate_mlp
            bias[1] += GATE_BIAS
            bias[3] += GATE_BIAS
    n = len(a["vae_block_out_channels"])
    vae = seeded(1, lambda: AutoencoderKLFlux2(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(a["vae_block_out_channels"]), layers_per_block=a["vae_layers_per_block"],
        norm_num_groups=a["vae_norm_num_groups"], sample_size=64, patch_size=(2, 2)))
    with torch.no_grad():  # batch-norm statistics as a trained VAE has them (fresh ones are 0 / 1)
        c = vae.bn.num_features
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, c))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, c))
    text_encoder = seeded(2, lambda: make_qwen3vl(a, tokenizer))
    # The pipeline sets its own logit-normal sigmas (set_timesteps(sigmas=...)): no shift of the scheduler's
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    pipe = Ideogram4Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=conditional, unconditional_transformer=unconditional)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# The learning check's settings for this module's tiny model (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image, each choice's
# measured reason beside it. 64 wide (4 heads x 16), 2 blocks, SwiGLU 128: with the builder's closed gates (tanh
# ~0.1) the ratio was 0.514 at lr 3e-3 and 0.496 at 1e-2 (the lr was not what limited it); with GATE_BIAS 0.068 at
# lr 3e-3 in 68 s (2 cores, shared), so the defaults of the other 64-wide tiny models are kept.
LEARNS = {"tiny_ideogram4": {"arch": {"num_attention_heads": 4, "num_layers": 2, "intermediate_size": 128},
                             "rank": 16, "steps": 300, "lr": 3e-3}}
