"""A tiny, deterministic Qwen-Image 2.1 pipeline (QwenImage21Pipeline: the single-stream block-causal
QwenImage21Transformer2DModel, the 64-channel /16 AutoencoderKLQwenImage21 reading RGBA, Qwen3-VL as text encoder),
built offline from the real classes (conventions: tasks/models/tiny/common.py).

The pipeline's processor is a Qwen3VLProcessor, which transformers builds only with torchvision (its video
processor), absent here: processor/ is written as the real repository has it (the tokenizer with its chat template
and the Qwen2-VL image processor's config) and model_index.json names Qwen3VLProcessor; loraflow reads it with
tasks/models/qwenimage21.py's `text_processor` (text-to-image needs only the tokenizer and the chat template)."""
from __future__ import annotations

import json
from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler

from tasks.models.tiny.common import corpus, qwen_bpe_tokenizer, resolve_arch, seeder

# QwenImage21Pipeline.sys_prompt: its tokens (the system turn, counted by the processor's chat template) are
# dropped from the hidden states; learnt whole-word so the tiny tokenizer spends few tokens on it
SYSTEM = "Comprehend and analyze the provided prompt."

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
             "<|image_pad|>", "<|video_pad|>"]

# Qwen3-VL's chat template for what the pipeline renders (a message's content a string or a list of text/image
# parts, as Qwen3-VL's own template reads it)
QWEN3VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}{%- elif part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3-VL's image processor (Qwen/Qwen3-VL-8B-Instruct preprocessor_config.json): 16 px patches merged 2x2
_IMAGE_PROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                        image_std=[0.5, 0.5, 0.5], min_pixels=65536, max_pixels=16777216)

QWENIMAGE21_ARCH: dict = {
    # QwenImage21Transformer2DModel; context_in_dim = qwen_hidden_size; axes_dims_rope sum to attention_head_dim
    "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "axes_dims_rope": (4, 6, 6), "mlp_ratio": 3,
    # AutoencoderKLQwenImage21: 4 downsamplings -> /16 as the real one; RGBA in and out (in/out_channels 4)
    "z_dim": 8, "vae_base_dim": 8, "vae_dim_mult": (1, 2, 2, 2, 2), "vae_num_res_blocks": 1,
    # Qwen3VLForConditionalGeneration (the text model; a 1-layer vision tower text-to-image never runs)
    "qwen_hidden_size": 32, "qwen_layers": 2, "qwen_heads": 2, "qwen_kv_heads": 1, "qwen_head_dim": 16,
    "qwen_intermediate_size": 37, "qwen_mrope_section": (2, 3, 3),  # sums to head_dim / 2
    "qwen_num_merges": 300,
}


def qwen3vl_tokenizer(num_merges: int):
    lines = corpus() + [SYSTEM, "system", "user", "assistant"] * 40  # role names start a line
    return qwen_bpe_tokenizer(num_merges, lines, _SPECIALS, QWEN3VL_CHAT_TEMPLATE)


def build_tiny_qwenimage21(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `QwenImage21Pipeline` saved in diffusers layout under `out_dir`. Keys of QWENIMAGE21_ARCH.
    Images are multiples of 32 px (VAE /16, one text-encoder image slot per 2x2 latents)."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from tasks.models.tiny.qwen3vl_text_processor import text_processor_cls

    TextProcessor = text_processor_cls()

    a = resolve_arch(QWENIMAGE21_ARCH, arch)
    tokenizer = qwen3vl_tokenizer(a["qwen_num_merges"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIALS}
    seeded = seeder(seed, 3)
    transformer = seeded(0, lambda: QwenImage21Transformer2DModel(
        patch_size=1, in_channels=a["z_dim"], out_channels=a["z_dim"], num_layers=a["num_layers"],
        attention_head_dim=a["attention_head_dim"], num_attention_heads=a["num_attention_heads"],
        context_in_dim=a["qwen_hidden_size"], mlp_ratio=a["mlp_ratio"], axes_dims_rope=tuple(a["axes_dims_rope"]),
    ))
    n = len(a["vae_dim_mult"])
    vae = seeded(1, lambda: AutoencoderKLQwenImage21(
        base_dim=a["vae_base_dim"], decoder_base_dim=a["vae_base_dim"], z_dim=a["z_dim"],
        dim_mult=list(a["vae_dim_mult"]), num_res_blocks=a["vae_num_res_blocks"],
        temperal_downsample=[False] + [True] * (n - 2),
        # per-channel statistics as the real VAE has (its own 64 values are for z_dim 64)
        latents_mean=[round(0.1 * (i - a["z_dim"] / 2), 4) for i in range(a["z_dim"])],
        latents_std=[round(1.0 + 0.25 * i, 4) for i in range(a["z_dim"])],
    ))
    text_encoder = seeded(2, lambda: Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=a["qwen_hidden_size"],
                         intermediate_size=a["qwen_intermediate_size"], num_hidden_layers=a["qwen_layers"],
                         num_attention_heads=a["qwen_heads"], num_key_value_heads=a["qwen_kv_heads"],
                         head_dim=a["qwen_head_dim"], max_position_embeddings=2048, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": list(a["qwen_mrope_section"]), "mrope_interleaved": True},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=a["qwen_hidden_size"],
                           patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )))
    scheduler = FlowMatchEulerDiscreteScheduler(  # the pipeline's calculate_shift defaults, dynamic shifting
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    pipe = QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer,
                               processor=TextProcessor(tokenizer))
    pipe.register_modules(processor=None)  # not a transformers class: processor/ is written below
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    Qwen2VLImageProcessorPil(**_IMAGE_PROCESSOR).save_pretrained(out_dir / "processor")
    tokenizer.save_pretrained(out_dir / "processor")
    (out_dir / "processor" / "chat_template.jinja").write_text(QWEN3VL_CHAT_TEMPLATE)
    index = json.loads((out_dir / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image, each choice's measured
# reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# Qwen-Image's settings (4 heads of 16: 64 wide, rank 16, lr 3e-3, 300 steps) on the default targets (every Linear
# of the blocks): measured ratio 0.160 for each file (diffusers, kohya and ComfyUI merged) in 296 s on 2 shared
# cores; the misnamed-block and halved-scale mutations of each file read 0.368 and 0.552
LEARNS = {"tiny_qwenimage21": {"arch": {"num_attention_heads": 4}, "rank": 16, "steps": 300, "lr": 3e-3}}
