"""Base models for `merge --into-base` and `extract`: a denoiser's weights from a diffusers folder (a pipeline folder
or its transformer/ or unet/ subfolder) or a single .safetensors file in diffusers' key layout, and the merged
denoiser written as one file.

Only safetensors are read (a .bin next to them is a pickle and is never loaded). The whole denoiser is held in
memory, as float tensors of its own dtype."""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import NamedTuple

from tasks.lazy import lazy
from tasks.lora_tools.lora_files import LoraToolError, read_header
from tasks.lora_tools.ldm import unet_to_ldm
from tasks.lora_tools.transformer_layouts import to_original
from tasks.models import adapter_class
from tasks.training.export import FAMILIES, write_safetensors

st = lazy("safetensors.torch")

DIFFUSERS_LAYOUT, ORIGINAL_LAYOUT = "diffusers", "original"
LAYOUTS = (DIFFUSERS_LAYOUT, ORIGINAL_LAYOUT)
# the families whose original single-file layout is written (ldm.py: the UNets; transformer_layouts.py)
# the families whose adapter declares an original layout; the others are refused by check_layout
ORIGINAL_FAMILIES = tuple(f for f in FAMILIES if adapter_class(f).original_layout)
_WEIGHTS = "diffusion_pytorch_model.safetensors"


class Denoiser(NamedTuple):
    path: Path  # as given
    component: str | None  # "transformer" / "unet" (the diffusers LoRA prefix), None for a bare file
    config: dict | None  # its config.json, None for a bare file
    files: list[Path]
    family: str | None  # from the pipeline's model_index.json


def pipeline_family(model_dir: Path, what: str) -> str | None:
    """The family of a pipeline folder, from model_index.json's pipeline class (the adapters' pipeline_cls)."""
    from tasks.models import adapter_class

    index = model_dir / "model_index.json"
    if not index.is_file():
        return None
    try:
        parts = json.loads(index.read_text())
    except ValueError:
        raise LoraToolError(f"{what}: {index} is not JSON") from None
    name = parts.get("_class_name")
    # the LazyClass's name, read without importing the pipeline (which imports transformers' processors)
    found = [f for f in FAMILIES if inspect.getattr_static(adapter_class(f), "pipeline_cls").name == name]
    # families sharing a pipeline class (Wan 2.1 and 2.2: WanPipeline) differ in the denoisers the folder has
    found = [f for f in found if all((parts.get(c) or [None])[0] for c in adapter_class(f).denoiser_components)]
    if found:
        return max(found, key=lambda f: len(adapter_class(f).denoiser_components))
    raise LoraToolError(f"{what}: a {name} folder; loraflow knows the pipelines of {', '.join(FAMILIES)}")


def locate(path, what: str, expert: str | None = None, any_expert: bool = False) -> Denoiser:
    """Where a denoiser's weights and config are, checked (headers only: no weights are read here). A pipeline
    with several denoisers (Wan 2.2's experts) needs `expert`, one of its adapter's `experts` (`any_expert`:
    the first, where only the names and widths are read: the experts share them)."""
    from tasks.models import adapter_class

    p = Path(path)
    if not p.exists():
        raise LoraToolError(f"{what} {path}: no such file or folder")
    if p.is_file():
        if expert:
            raise LoraToolError(f"--expert {expert}: {what} {path} is one file (one denoiser); drop --expert")
        read_header(p, f"{what} {path}")
        return Denoiser(p, None, None, [p], None)
    family = pipeline_family(p, f"{what} {path}")
    experts = adapter_class(family).experts if family else {}
    if expert is not None and expert not in experts:
        raise LoraToolError(f"--expert {expert}: " + (f"{what} {path} has the experts {', '.join(experts)}" if experts
                            else f"{what} {path} is a one-denoiser model; drop --expert"))
    if experts and expert is None and any_expert:
        expert = next(iter(experts))
    if experts and expert is None:
        raise LoraToolError(f"{what} {path}: a {family} model has {len(experts)} denoisers: pass --expert "
                            f"{' or --expert '.join(experts)} (a LoRA for all of them: once per expert)")
    if family is not None:
        subs = [p / s for s in ((experts[expert],) if experts else ("transformer", "unet"))
                if (p / s / "config.json").is_file()]
        if not subs:
            raise LoraToolError(f"{what} {path}: the pipeline folder has no transformer/ or unet/ subfolder")
        sub = subs[0]
    elif (p / "config.json").is_file():
        sub = p
    else:
        raise LoraToolError(f"{what} {path}: not a diffusers folder (no model_index.json or config.json)")
    try:
        config = json.loads((sub / "config.json").read_text())
    except ValueError:
        raise LoraToolError(f"{what}: {sub / 'config.json'} is not JSON") from None
    component = (adapter_class(family).lora_file_component if family else None) or (  # the LoRA files' prefix
        sub.name if sub.name in ("transformer", "unet") else "unet" if "UNet" in str(config.get("_class_name"))
        else "transformer")
    index = sub / f"{_WEIGHTS}.index.json"
    if index.is_file():  # sharded: the index names the shards
        files = sorted({sub / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (sub / _WEIGHTS).is_file():
        files = [sub / _WEIGHTS]
    else:
        raise LoraToolError(f"{what} {path}: {sub} has no {_WEIGHTS} (.bin pickles are not read; convert them)")
    for f in files:
        read_header(f, f"{what} {path}: {f.name}")
    return Denoiser(p, component, config, files, family)


def load_weights(den: Denoiser) -> dict:
    out = {}
    for f in den.files:
        try:
            out.update(st.load_file(str(f)))
        except Exception as e:  # safetensors' checks beyond the header's
            raise LoraToolError(f"{f}: not a readable safetensors file ({e})") from None
    return out


def check_layout(layout: str, family: str) -> None:
    if layout == ORIGINAL_LAYOUT and family not in ORIGINAL_FAMILIES:
        raise LoraToolError(f"--layout original: written for {', '.join(ORIGINAL_FAMILIES)} only, not {family}; use "
                            "--layout diffusers")


def write_denoiser(path, state_dict: dict, layout: str, family: str, config: dict | None, metadata: dict) -> Path:
    """The merged denoiser as one file: diffusers keys (the denoiser folder's own; any family), or the original
    single-file keys (SD1.5/SDXL `model.diffusion_model.*`; Z-Image's fused qkv; Qwen-Image's, which are
    diffusers'). Atomic, as every file here."""
    check_layout(layout, family)
    if layout == ORIGINAL_LAYOUT and adapter_class(family).original_layout != "ldm":  # transformer_layouts.py
        try:
            state_dict = to_original(family, state_dict)
        except ValueError as e:
            raise LoraToolError(f"--layout original: {e}; use --layout diffusers") from None
    elif layout == ORIGINAL_LAYOUT:
        try:
            state_dict = unet_to_ldm(config, state_dict)
        except (NotImplementedError, KeyError, ValueError) as e:
            raise LoraToolError(f"--layout original: this UNet does not convert ({e}); use --layout diffusers") \
                from None
    return write_safetensors(path, state_dict, metadata)
