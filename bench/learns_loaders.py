"""How bench/learns.py loads an exported LoRA file into a family's own diffusers pipeline: `load_pipeline` (the
run's base folder, `from_pretrained`), and `merge_kohya` for the files diffusers cannot read, merged as ComfyUI
merges them (W += alpha/rank * up @ down on the original checkpoint's Linear)."""
from __future__ import annotations

import sys
from pathlib import Path


def merged() -> dict[str, str]:
    """{pipeline class: family} of the families whose kohya file diffusers cannot read (each declares it:
    `reference_kohya = "merge"`): merged as ComfyUI does instead."""
    from tasks.models import FAMILIES, adapter_class

    return {adapter_class(f).pipeline_cls.__name__: f for f in FAMILIES if adapter_class(f).reference_kohya == "merge"}


MERGED = merged()


def denoiser_of(pipe):
    return pipe.transformer if hasattr(pipe, "transformer") else pipe.unet


def model_family(model: str) -> tuple[str, int]:
    """(family, model.max_sequence_length) of a learning-check model (`tiny_wan22+both`: conf/model/tiny_wan22.yaml)."""
    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / f"{model.split('+')[0]}.yaml")
    return conf.family, int(conf.max_sequence_length)


def load_pipeline(base: Path, model: str):
    """The family's own diffusers pipeline on the run's base folder (FamilyAdapter.reference_pipeline)."""
    from tasks.models import adapter_class

    family, text_tokens = model_family(model)
    pipe = adapter_class(family).reference_pipeline(base, text_tokens)
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
