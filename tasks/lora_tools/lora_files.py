"""LoRA files in and out, kohya or diffusers/PEFT layout, and the one in-memory form the tools work on.

In memory a LoRA is {module: Pair(down [rank, in], up [out, rank], alpha)}, delta = alpha / rank * up @ down: the
kohya rule. A PEFT file's scale (lora_alpha / r, or / sqrt(r) with rslora, per module with rank/alpha patterns)
becomes the alpha that gives the same scale. Module names are the file's own (kohya `lora_unet_double_blocks_0_
img_attn_qkv`; diffusers `transformer.transformer_blocks.0.attn.to_q`, component prefix kept), so a file read and
written in its own format keeps them; names.py converts between the layouts.

Files are checked from their header (plain JSON) before torch is imported: a bad argument costs no start-up.
Nothing here unpickles: safetensors only."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

from tasks.lazy import lazy
from tasks.training.export import FAMILIES, LORA_META, kohya_metadata, write_safetensors

torch = lazy("torch")
st = lazy("safetensors.torch")

KOHYA, DIFFUSERS = "kohya", "diffusers"
FORMATS = (KOHYA, DIFFUSERS)
_KOHYA_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".alpha")
_PEFT_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
# Other adapter kinds, told apart by key so the message names what the file is
_OTHER_KINDS = {r"\.hada_w": "LoHa", r"\.lokr_w": "LoKr", r"\.dora_scale$": "DoRA", r"lora_magnitude_vector": "DoRA",
                r"\.lora_mid\.": "LoCon (Tucker)", r"\.diff(_b)?$": "full-weight difference",
                r"\.lora_embedding_": "embedding LoRA"}
_PICKLES = {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"}
# ss_base_model_version (what export.kohya_metadata writes, as sd-scripts does) -> family
# (first wins: a FLUX.1 Kontext file says flux1 too, and has Flux's names and layout)
_VERSION_FAMILY = {v: f for f in reversed(FAMILIES) for v in [kohya_metadata(f, 1, 1)["ss_base_model_version"]]}


class LoraToolError(ValueError):
    """Bad input: the CLI prints the message as one line and exits 2."""


class Pair(NamedTuple):
    down: "torch.Tensor"  # [rank, in]
    up: "torch.Tensor"  # [out, rank]
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Lora(NamedTuple):
    path: Path
    format: str
    modules: dict  # name -> Pair
    metadata: dict
    family: str | None  # from the file's metadata, when it says one loraflow knows
    said: str | None  # what the metadata says, known or not (for the message when it is unknown)


def read_header(path, what: str = "") -> tuple[dict, dict]:
    """(tensor name -> {dtype, shape, data_offsets}, metadata) of a safetensors file, without torch."""
    path, what = Path(path), what or str(path)
    if not path.exists():
        raise LoraToolError(f"{what}: no such file")
    if path.is_dir():
        raise LoraToolError(f"{what}: a folder, not a .safetensors file")
    if path.suffix.lower() in _PICKLES:
        raise LoraToolError(f"{what}: a pickle file ({path.suffix}), which can run code when loaded; "
                            "only .safetensors files are read (convert it with safetensors' convert script)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        try:
            if not 1 < n <= size - 8:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
            meta = header.pop("__metadata__", None) or {}
            end = max([v["data_offsets"][1] for v in header.values()], default=0)
            if 8 + n + end != size or not isinstance(meta, dict):
                raise ValueError("header and size disagree")
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise LoraToolError(f"{what}: not a safetensors file ({e}); give a .safetensors file") from None
    return header, meta


def detect_format(keys, what: str) -> str:
    """kohya or diffusers, from the key names alone."""
    keys = list(keys)
    for marker, kind in _OTHER_KINDS.items():
        if hits := [k for k in keys if re.search(marker, k)]:
            raise LoraToolError(f"{what}: a {kind} file ({hits[0]}); only plain LoRA files (kohya or "
                                "diffusers/PEFT layout) are supported")
    kohya = [k for k in keys if k.endswith(_KOHYA_SUFFIXES)]
    peft = [k for k in keys if k.endswith(_PEFT_SUFFIXES)]
    if not kohya and not peft:
        raise LoraToolError(f"{what}: not a LoRA (no `.lora_down.weight` or `.lora_A.weight` keys; "
                            f"e.g. {keys[:1]}): is it a model checkpoint?")
    if kohya and peft:
        raise LoraToolError(f"{what}: mixes kohya ({kohya[0]}) and diffusers ({peft[0]}) keys: unknown LoRA format")
    fmt, known = (KOHYA, kohya) if kohya else (DIFFUSERS, peft)
    if len(known) != len(keys):
        other = next(k for k in keys if k not in set(known))
        raise LoraToolError(f"{what}: key {other!r} is not part of a plain {fmt} LoRA: unknown LoRA format")
    return fmt


def _pattern_value(patterns: dict, module: str, default):
    """peft's rule for rank_pattern/alpha_pattern keys: a key matches a module path ending in it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _peft_scales(meta: dict, modules, what: str) -> dict[str, float]:
    """diffusers' `lora_adapter_metadata` -> the scale of each module; without it diffusers loads at scale 1."""
    try:
        adapters = json.loads(meta[LORA_META]) if LORA_META in meta else {}
    except ValueError:
        raise LoraToolError(f"{what}: its {LORA_META} metadata is not JSON") from None
    scales = {}
    for module in modules:
        component, rest = module.split(".", 1) if "." in module else ("", module)
        c = {k[len(component) + 1:]: v for k, v in adapters.items() if k.startswith(component + ".")}
        if "r" not in c:
            scales[module] = 1.0
            continue
        r = _pattern_value(c.get("rank_pattern") or {}, rest, c["r"])
        a = _pattern_value(c.get("alpha_pattern") or {}, rest, c.get("lora_alpha", r))
        scales[module] = a / (r ** 0.5 if c.get("use_rslora") else r)
    return scales


def read_lora(path, what: str = "") -> Lora:
    """A LoRA file in either layout, checked, in the in-memory form."""
    path = Path(path)
    what = what or str(path)
    header, meta = read_header(path, what)
    fmt = detect_format(header, what)
    down_s, up_s = (".lora_down.weight", ".lora_up.weight") if fmt == KOHYA else _PEFT_SUFFIXES
    names = sorted({k[: -len(s)] for k in header for s in (down_s, up_s, ".alpha") if k.endswith(s)})
    for m in names:
        if f"{m}{down_s}" not in header or f"{m}{up_s}" not in header:
            raise LoraToolError(f"{what}: module {m} lacks its {down_s if f'{m}{up_s}' in header else up_s} "
                                "tensor: a damaged or partial LoRA file")
        d, u = header[f"{m}{down_s}"]["shape"], header[f"{m}{up_s}"]["shape"]
        if len(d) != 2 or len(u) != 2:
            raise LoraToolError(f"{what}: module {m} has {len(d)}-d weights: convolution LoRAs (LoCon) are not "
                                "supported, only Linear ones")
        if d[0] != u[1] or d[0] == 0:
            raise LoraToolError(f"{what}: module {m}: down is {d}, up is {u}: their ranks must match")
    try:
        tensors = st.load_file(str(path))
    except Exception as e:  # safetensors' own checks (dtype, overlapping offsets) beyond the header's
        raise LoraToolError(f"{what}: not a readable safetensors file ({e})") from None
    if fmt == KOHYA:
        # no `.alpha`: sd-scripts' loaders use alpha = rank (scale 1)
        modules = {m: Pair(tensors[m + down_s], tensors[m + up_s],
                           float(tensors[m + ".alpha"].float().item()) if m + ".alpha" in tensors
                           else float(tensors[m + down_s].shape[0])) for m in names}
    else:
        scales = _peft_scales(meta, names, what)
        modules = {m: Pair(tensors[m + down_s], tensors[m + up_s], scales[m] * tensors[m + down_s].shape[0])
                   for m in names}
    said = meta.get("ss_base_model_version")
    return Lora(path, fmt, modules, meta, _VERSION_FAMILY.get(said), said)


def _summary(values) -> str:
    values = sorted(set(values))
    return str(values[0]) if len(values) == 1 else "Dynamic"  # sd-scripts' word for per-module ranks


def lora_metadata(modules: dict, family: str | None, fmt: str, carry: dict | None = None, **info) -> dict:
    """Metadata of a written LoRA: `carry` (the input's, for resize/convert) without what describes the old
    tensors, sd-scripts' ss_* family keys (kohya_metadata) when the family is known, and `info`."""
    meta = {k: v for k, v in (carry or {}).items() if k not in (LORA_META, "format", "ss_network_dim",
                                                                 "ss_network_alpha")}
    ranks = [p.rank for p in modules.values()]
    alphas = [p.rank if fmt == DIFFUSERS else p.alpha for p in modules.values()]  # diffusers: alpha baked in
    if family:
        meta.update(kohya_metadata(family, max(ranks), max(alphas)))
    meta.update({"ss_network_dim": _summary(ranks), "ss_network_alpha": _summary(float(a) for a in alphas)})
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()})
    return meta


def _diffusers_tensors(modules: dict) -> tuple[dict, dict]:
    """PEFT keys with the scale multiplied into lora_B (what export.bake_alpha does to loraflow's own file:
    ComfyUI reads no peft config and applies PEFT keys at scale 1), and the peft config per component, with
    rank/alpha patterns where ranks differ so diffusers builds each module at its own rank."""
    tensors, components = {}, {}
    for name, p in modules.items():
        tensors[f"{name}.lora_A.weight"] = p.down.contiguous()
        tensors[f"{name}.lora_B.weight"] = (p.up.double() * p.scale).to(p.up.dtype).contiguous()
        component, rest = name.split(".", 1)
        components.setdefault(component, {})[rest] = p.rank
    config = {}
    for component, ranks in components.items():
        r = max(set(ranks.values()), key=list(ranks.values()).count)  # the commonest rank; the others by pattern
        pattern = {m: k for m, k in ranks.items() if k != r}
        config.update({f"{component}.{k}": v for k, v in {
            "r": r, "lora_alpha": r, "rank_pattern": pattern, "alpha_pattern": pattern,
            "target_modules": sorted(ranks), "use_rslora": False, "use_dora": False, "lora_dropout": 0.0,
            "bias": "none"}.items()})
    return tensors, {LORA_META: json.dumps(config, indent=2, sort_keys=True), "format": "pt"}


def write_lora(path, modules: dict, fmt: str, metadata: dict) -> Path:
    """Write atomically (export.write_safetensors: a crash or Ctrl-C leaves the old file or the new one)."""
    if fmt == KOHYA:
        tensors = {}
        for name, p in modules.items():
            tensors[f"{name}.lora_down.weight"] = p.down.contiguous()
            tensors[f"{name}.lora_up.weight"] = p.up.contiguous()
            tensors[f"{name}.alpha"] = torch.tensor(float(p.alpha))
        return write_safetensors(path, tensors, metadata)
    if any("." not in name for name in modules):
        raise LoraToolError(f"{path}: diffusers LoRA keys need a component prefix (transformer., unet.)")
    tensors, peft_meta = _diffusers_tensors(modules)
    return write_safetensors(path, tensors, {**metadata, **peft_meta})
