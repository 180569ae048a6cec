"""How bench/learns.py loads an exported LoRA file into a family's own diffusers pipeline: `load_pipeline` (the
run's base folder, `from_pretrained`), and `merge_kohya` for the files diffusers cannot read, merged as ComfyUI
merges them (W += alpha/rank * up @ down on the original checkpoint's Linear)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

# The pipelines whose kohya files diffusers cannot read (module docstring): merged as ComfyUI does instead.
MERGED = {"FluxPipeline": "flux", "FluxKontextPipeline": "flux_kontext", "StableDiffusion3Pipeline": "sd3",
          "LTX2Pipeline": "ltx2",  # LTX-2: diffusers reads no kohya layout for it
          "HunyuanVideo15Pipeline": "hunyuan_video15",  # nor for HunyuanVideo 1.5 (ComfyUI's fused names)
          "HunyuanVideo15ImageToVideoPipeline": "hunyuan_video15_i2v"}
# The image-to-video pipelines (bench/learns.py renders them from the clip's first frame, `image=`)
I2V_PIPELINES = ("WanImageToVideoPipeline", "HunyuanVideo15ImageToVideoPipeline")


def denoiser_of(pipe):
    return pipe.transformer if hasattr(pipe, "transformer") else pipe.unet


def load_pipeline(base: Path, i2v: bool = False):
    """The base's own pipeline; `i2v`: its image-to-video pipeline, the class model_index.json names, but for Wan
    2.2 TI2V-5B's WanPipeline folder, which WanImageToVideoPipeline reads."""
    import diffusers
    from diffusers import DiffusionPipeline

    if i2v:
        name = json.loads((base / "model_index.json").read_text())["_class_name"]
        cls = getattr(diffusers, "WanImageToVideoPipeline" if name == "WanPipeline" else name)
        assert cls.__name__ in I2V_PIPELINES, f"{base}: {name} is no image-to-video pipeline"
        pipe = cls.from_pretrained(base, use_safetensors=True)
    elif json.loads((base / "model_index.json").read_text())["_class_name"] == "QwenImageEditPlusPipeline":
        from tasks.models.qwenimage_edit import (
            vision_text_processor,  # see its docstring: no torchvision here
        )

        pipe = DiffusionPipeline.from_pretrained(base, use_safetensors=True, processor=None)
        pipe.processor = vision_text_processor(base)
    else:
        pipe = DiffusionPipeline.from_pretrained(base, use_safetensors=True)
    if type(pipe).__name__ in ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"):  # its text
        # windows, as the adapter trained them
        from tasks.models.hunyuan_video15 import HunyuanVideo15Adapter

        HunyuanVideo15Adapter(base, "float32", TEXT_TOKENS).set_text_lengths(pipe)
        pipe.guider = pipe.guider.new(guidance_scale=1.0)  # no CFG: the pipeline takes its scale from the guider
    pipe.set_progress_bar_config(disable=True)
    return pipe


TEXT_TOKENS = 32  # the tiny video models' model.max_sequence_length


def load_diffusers_file(pipe, file: Path) -> None:
    """The diffusers file through the pipeline's loader, or the transformer's where the pipeline has none."""
    if hasattr(pipe, "load_lora_weights"):
        pipe.load_lora_weights(str(file))
    else:  # HunyuanVideo 1.5 in diffusers 0.42.1 (tasks/models/hunyuan_video15.py)
        pipe.transformer.load_lora_adapter(str(file), prefix="transformer", use_safetensors=True)


def merge_kohya(pipe, file: Path, family: str | None = None) -> None:
    """ComfyUI's rule for a kohya (or ComfyUI-layout) file: W += alpha/rank * up @ down on the original
    checkpoint's Linear, whose rows are the diffusers Linears it fuses (tasks/training/export.py's tables, read
    backwards). `family`: a ComfyUI-layout file's (Z-Image: fused q/k/v)."""
    import torch
    from safetensors.torch import load_file

    from tasks.training.export import kohya_rows
    from tasks.training.export_comfyui import comfyui_rows

    kohya = load_file(str(file))
    modules = dict(denoiser_of(pipe).named_modules())
    from tasks.training.export import named_layout

    merged = MERGED.get(type(pipe).__name__)
    rows = (comfyui_rows(family, modules) if family else  # LTX-2: one module per kohya name
            {m.replace(".", "_"): [m] for m in modules} if named_layout(merged) else kohya_rows(merged, modules))
    with torch.no_grad():
        for name in sorted({k.split(".")[0] for k in kohya}):
            if name.removeprefix("lora_unet_") not in rows:  # ComfyUI's "lora key not loaded": skipped
                print(f"merge: {name} matches no module of the model; not loaded", file=sys.stderr)
                continue
            down, up = kohya[f"{name}.lora_down.weight"], kohya[f"{name}.lora_up.weight"]
            delta = kohya[f"{name}.alpha"].item() / down.shape[0] * (up.float() @ down.float())
            targets = [modules[m] for m in rows[name.removeprefix("lora_unet_")]]
            for t, block in zip(targets, torch.split(delta, [t.weight.shape[0] for t in targets])):
                t.weight += block.to(t.weight.dtype)
