"""A tiny, deterministic Qwen-Image-Edit-Plus (2509) pipeline, built offline from the real classes: Qwen-Image's
tiny transformer, VAE and Qwen2.5-VL (qwenimage.qwenimage_parts) plus the processor the edit pipeline
feeds the control images through (Qwen2VLProcessor: the Qwen2-VL image processor, whose 14 px patches merged
2x2 become the `<|image_pad|>` tokens the vision tower fills). Same conventions as common.py."""
from __future__ import annotations

import json
from pathlib import Path

from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_qwenimage import LEARNS as QWENIMAGE_LEARNS
from tasks.models.tiny.tiny_qwenimage import QWENIMAGE_ARCH, qwen25vl_tokenizer, qwenimage_parts

# QwenImageEditPlusPipeline.prompt_template_encode's system text: the pipeline drops the template's first 64
# tokens (prompt_template_encode_start_idx), counted with the real tokenizer; the tiny one learns this text
# whole-word so the same 64 are dropped (tests/test_qwenimage_edit.py checks it).
QWENIMAGE_EDIT_SYSTEM = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate.")

# Qwen2.5-VL's real preprocessor settings (Qwen/Qwen-Image-Edit-2509 processor/preprocessor_config.json)
_IMAGE_PROCESSOR = dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=12845056,
                        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])


def build_tiny_qwenimage_edit(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `QwenImageEditPlusPipeline` saved in diffusers layout under `out_dir` (keys of
    QWENIMAGE_ARCH, as tiny_qwenimage). Images are multiples of 16 px; the text sequence holds the control
    images' vision tokens (196 for one 384x384-area condition image) before the caption."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessorPil

    a = resolve_arch(QWENIMAGE_ARCH, arch)
    tokenizer = qwen25vl_tokenizer(a["qwen_num_merges"], system=QWENIMAGE_EDIT_SYSTEM)
    # Qwen2VLProcessor cannot be built here (transformers checks for its video processor, which needs
    # torchvision): processor/ is written as the real repository has it (the image processor's config and the
    # tokenizer) and model_index.json names Qwen2VLProcessor; loraflow reads it (tasks/models/qwenimage_edit.py)
    pipe = QwenImageEditPlusPipeline(tokenizer=tokenizer, processor=None,
                                     **qwenimage_parts(a, tokenizer, seeder(seed, 3)))
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    Qwen2VLImageProcessorPil(**_IMAGE_PROCESSOR).save_pretrained(out_dir / "processor")
    tokenizer.save_pretrained(out_dir / "processor")
    index = json.loads((out_dir / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
# Qwen-Image-Edit: its pipeline encodes the control at ~1 MP (4096 tokens beside the target's 16), so one image a
# batch: measured 0.128 in 2.5 min (a batch of 4: 0.074 in 9 min on 2 cores)
LEARNS = {"tiny_qwenimage_edit": {**QWENIMAGE_LEARNS["tiny_qwenimage"], "control": True, "batch": 1}}
