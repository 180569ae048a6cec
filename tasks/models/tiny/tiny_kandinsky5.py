"""A tiny, deterministic Kandinsky 5.0 text-to-video pipeline (`Kandinsky5T2VPipeline`, the
kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers layout) built offline from the real diffusers/transformers
classes: Kandinsky5Transformer3DModel (text encoder blocks, then visual decoder blocks with cross-attention; 1x2x2
patches; `visual_cond` as the released video models: noisy | condition | mask channels), AutoencoderKLHunyuanVideo
(/8 in space, /4 in time, 1 + 4k frames), Qwen2_5_VLForConditionalGeneration (a 1-layer vision tower the pipeline
never runs) with a Qwen2 tokenizer, CLIPTextModel with a CLIP tokenizer (its pooled output) and the flow-matching
Euler scheduler.

Conventions of common.py: weights depend only on `seed` (same seed -> byte-identical files), one seed per
component, the caller's global RNG is untouched, `arch` overrides keys of `K5_ARCH` (unknown key -> ValueError).

The real folder's tokenizer/ is a Qwen2VLProcessor; transformers builds one only with torchvision (not installed
here) and the pipeline calls it with text alone (images=None, videos=None), which the processor hands to its
tokenizer: the tiny folder holds that tokenizer (Qwen2Tokenizer), which takes the same call. The pipeline drops
the first 128 tokens of its prompt template (`prompt_template_encode_start_idx`, counted with the real
tokenizer); the tiny tokenizer learns its merges with the template's system text weighted in, so the dropped
prefix is the template there too (tests/test_kandinsky5.py checks it)."""
from __future__ import annotations

import re
from pathlib import Path

from tasks.models.tiny.common import clip_tokenizer, make_clip, resolve_arch, seeder
from tasks.models.tiny.tiny_qwenimage import QWEN25VL_SPECIALS, qwen25vl_tokenizer

K5_ARCH: dict = {
    # Kandinsky5Transformer3DModel: head dim = sum(axes_dims) (model_dim / head dim heads); in_text_dim is the Qwen
    # width, in_text_dim2 the CLIP width (derived)
    "model_dim": 32, "ff_dim": 64, "time_dim": 16, "num_text_blocks": 1, "num_visual_blocks": 2,
    "axes_dims": (4, 6, 6), "visual_cond": True,
    # AutoencoderKLHunyuanVideo: four levels, the first three halve the sides (/8), the last two the time (/4)
    "latent_channels": 4, "vae_block_out_channels": (8, 8, 16, 16), "vae_layers_per_block": 1,
    "vae_norm_num_groups": 4, "scaling_factor": 0.476986,  # the real VAE's
    # Qwen2_5_VLForConditionalGeneration (the pipeline reads hidden_states[-1])
    "qwen_hidden_size": 32, "qwen_layers": 2, "qwen_heads": 2, "qwen_kv_heads": 2, "qwen_intermediate_size": 37,
    "qwen_mrope_section": (2, 2, 4), "qwen_num_merges": 400,
    # CLIPTextModel (clip-vit-large-patch14 is 768 wide)
    "clip_hidden_size": 32, "clip_intermediate_size": 37, "clip_layers": 2, "clip_heads": 2, "clip_num_merges": 300,
    # the original configs' scheduler_scale for the video models (musubi-tuner kandinsky5/configs.py, 10.0)
    "shift": 10.0,
}


# A word of the template learnt in pieces, so that the tiny tokenizer's template prefix is the 128 tokens the pipeline
# drops (learnt whole it is 125; "postprocessing" split this way gives 128): the tests hold the count and that the
# caption starts right after it, not where the real tokenizer splits its words (not checked here)
SPLIT = {"postprocessing": "post processing"}


def template_system() -> str:
    """The pipeline's prompt template before the caption, without its special tokens: what the tiny tokenizer
    learns whole-word (read from a pipeline built without components, which sets only its template)."""
    from diffusers import Kandinsky5T2VPipeline

    empty = Kandinsky5T2VPipeline(**dict.fromkeys(("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2",
                                                    "tokenizer_2", "scheduler")))
    prefix = empty.prompt_template.split("{}")[0]
    text = re.sub(r"<\|im_(start|end)\|>(system|user)?", "", prefix).strip()
    for word, pieces in SPLIT.items():
        text = text.replace(word, pieces)
    return text


def _qwen(a: dict, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN25VL_SPECIALS}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
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
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"]))


def with_live_modulation(transformer):
    """Kandinsky5Modulation zero-initialises its Linear (every gate 0: each block passes its input through, so a
    LoRA gets no gradient); the released models' are trained. Drawn small and random here, in the caller's seed."""
    import torch

    with torch.no_grad():
        for name, module in transformer.named_modules():
            if type(module).__name__ == "Kandinsky5Modulation":
                module.out_layer.weight.normal_(0.0, 0.2)
                module.out_layer.bias.normal_(0.0, 0.2)
    return transformer


def k5_parts(a: dict, seeded) -> dict:
    """The components Kandinsky5T2VPipeline and Kandinsky5I2VPipeline share (seeds 0-3)."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky5Transformer3DModel
    from transformers import CLIPTextModel

    tokenizer = qwen25vl_tokenizer(a["qwen_num_merges"], system=template_system())
    tokenizer_2 = clip_tokenizer(a["clip_num_merges"])
    c = a["latent_channels"]
    transformer = seeded(0, lambda: with_live_modulation(Kandinsky5Transformer3DModel(
        in_visual_dim=c, out_visual_dim=c, in_text_dim=a["qwen_hidden_size"], in_text_dim2=a["clip_hidden_size"],
        time_dim=a["time_dim"], patch_size=(1, 2, 2), model_dim=a["model_dim"], ff_dim=a["ff_dim"],
        num_text_blocks=a["num_text_blocks"], num_visual_blocks=a["num_visual_blocks"],
        axes_dims=tuple(a["axes_dims"]), visual_cond=a["visual_cond"], attention_type="regular")))
    n = len(a["vae_block_out_channels"])
    vae = seeded(1, lambda: AutoencoderKLHunyuanVideo(
        latent_channels=c, down_block_types=("HunyuanVideoDownBlock3D",) * n,
        up_block_types=("HunyuanVideoUpBlock3D",) * n, block_out_channels=tuple(a["vae_block_out_channels"]),
        layers_per_block=a["vae_layers_per_block"], norm_num_groups=a["vae_norm_num_groups"],
        scaling_factor=a["scaling_factor"], spatial_compression_ratio=8, temporal_compression_ratio=4))
    text_encoder = seeded(2, lambda: _qwen(a, tokenizer))
    text_encoder_2 = seeded(3, lambda: make_clip(CLIPTextModel, a, tokenizer_2, a["clip_hidden_size"],
                                                 a["clip_hidden_size"]))
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=a["shift"]))


def build_tiny_kandinsky5(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `Kandinsky5T2VPipeline` saved in diffusers layout under `out_dir`. Clips are 1 + 4k
    frames, sides multiples of 16; call with e.g. height/width 32, num_frames 5, max_sequence_length 32."""
    from diffusers import Kandinsky5T2VPipeline

    a = resolve_arch(K5_ARCH, arch)
    pipe = Kandinsky5T2VPipeline(**k5_parts(a, seeder(seed, 4)))
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one clip, each choice's measured
# reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# The clip, its kohya file merged by ComfyUI's rule (diffusers reads none for it). Twice the default width (64),
# 300 steps: at 3e-3 0.023 for both files, but a halved scale still passed (0.101); at 1e-3 0.041 for both files, a
# misnamed block 0.435 and a halved scale 0.202, both caught; 188 s on 2 shared cores
LEARNS = {"tiny_kandinsky5": {"arch": {"model_dim": 64, "ff_dim": 128, "axes_dims": [4, 6, 6]}, "rank": 16,
                              "steps": 300, "lr": 1e-3, "clip": True}}
