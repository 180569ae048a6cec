"""Export a trained PEFT LoRA as a kohya-style .safetensors: the format ComfyUI, A1111/Forge and sd-scripts load.

Kohya layout: one entry per *original-checkpoint* Linear, `<name>.lora_down.weight` (rank x in),
`<name>.lora_up.weight` (out x rank) and a scalar `<name>.alpha`; the loader applies
W += (alpha / rank) * up @ down. The names are the ones sd-scripts (or the family's reference trainer) writes,
declared by each family on its adapter (`kohya = KohyaLayout(...)`, tasks/models/bases/adapter.py), in three kinds:

- "unet" (SD1.5, SDXL): diffusers' own `convert_state_dict_to_kohya` (`lora_unet_<diffusers name>`), SDXL's then
  renamed to SGM block names (`input_blocks_4_1_...`), which A1111, ComfyUI and diffusers load; a text-encoder
  LoRA (train.text_encoder_lr) is `lora_te_` / `lora_te1_` / `lora_te2_` + the transformers name.
- "named" (Z-Image, Qwen-Image(-Edit), LTX-2): `lora_unet_<diffusers module name, dots as underscores>`, where
  the diffusers names are the reference trainer's or ComfyUI's.
- "rules" (FLUX.1, Kontext, SD3, FLUX.2, Wan, HunyuanVideo 1.5): each diffusers Linear mapped to the original
  checkpoint's module (BFL's `double_blocks_0_img_attn_qkv`, SAI's `joint_blocks_0_x_block_attn_qkv`, Wan's
  `blocks_0_self_attn_q`), q/k/v (and Flux's single-block mlp) stacked into the fused original Linear; modules no
  kohya loader of the family has (FLUX.1's top-level `proj_out`) left out with a warning.

Where each file loads (and where one does not: diffusers reads no SD3 / LTX-2 / HunyuanVideo 1.5 kohya file):
docs/lora-files.md and the comments beside each declaration.

Pure core: no prefect/hydra imports.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from pathlib import Path

from tasks.store.stored_files import canonicalize_safetensors
from tasks.training.dora_export import dora_scales, split_dora
from tasks.lazy import lazy
from tasks.models import FAMILIES as REGISTRY, adapter_class
from tasks.models.bases.adapter import KohyaLayout

torch = lazy("torch")
state_dict_utils = lazy("diffusers.utils.state_dict_utils")
safetensors = lazy("safetensors")
st = lazy("safetensors.torch")

# The families: the registry's (tasks/models/__init__.py), in its order; each declares its kohya names
# (`kohya = KohyaLayout(...)` on its adapter, tasks/models/bases/adapter.py)
FAMILIES = tuple(REGISTRY)
LORA_META = "lora_adapter_metadata"  # diffusers' key for the peft config(s), "<component>.<field>"
CODE_VERSION = "5"  # bump when the key mapping, scaling or metadata changes: stored exports are re-derived
# A group rule's slots: q, k, v (and Flux's single-block mlp) within the original fused Linear; a SwiGLU's gate and
# up projections within a fused `gate_up` (Qwen-Image 2.1's ComfyUI model: gate rows first)
RULE_SLOTS = {"q": 0, "k": 1, "v": 2, "proj_mlp": 3, "gate_layer": 0, "proj": 1}
# Output width of each slot relative to q's: Flux's single block has mlp_ratio 4 (hard-wired in BFL's and
# diffusers' code: linear1 = 3 * 3072 + 12288). Used to zero-fill slots that were not trained.
_SLOT_WIDTH = (1, 1, 1, 4)


def layout(family: str) -> KohyaLayout:
    """The family's kohya names, as its adapter declares them."""
    return adapter_class(check_family(family)).kohya


def named_layout(family: str) -> bool:
    """Whether the family's kohya names are its diffusers module names, dots as underscores (one Linear each)."""
    return layout(family).names == "named"


def check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return family


def kohya_rows(family: str, module_names, rules: tuple | None = None) -> dict[str, list[str]]:
    """kohya module (without `lora_unet_`) -> the diffusers Linears of `module_names` that are its row blocks, in
    order (q, k, v(, mlp)): what a loader merging a kohya file onto a diffusers model needs (ComfyUI's
    flux_to_diffusers map, read backwards). Families with rules only; `rules`: others than the kohya file's
    (a family's `comfyui_rules`)."""
    rows: dict[str, dict[int, str]] = {}
    for module in module_names:
        for pattern, name, size in rules or layout(family).rules:
            if m := re.fullmatch(pattern, module):
                rows.setdefault(name.format(*m.groups()[:1]), {})[RULE_SLOTS[m.group(2)] if size > 1 else 0] = module
                break
    return {name: [slots[i] for i in sorted(slots)] for name, slots in rows.items()}


def lora_pairs(sd: dict[str, torch.Tensor], rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT `x.lora_A.weight`/`x.lora_B.weight` -> {x: (A, B)}; anything else (DoRA, lora bias) is refused."""
    out = {}
    for key, a in sd.items():
        if key.endswith(".lora_B.weight"):
            continue
        if not key.endswith(".lora_A.weight"):
            raise ValueError(f"not a plain LoRA key: {key}")
        module = key[: -len(".lora_A.weight")]
        if a.shape[0] != rank:  # the single alpha/rank scale below is only right if every module has this rank
            raise ValueError(f"{module}: rank {a.shape[0]} != {rank}")
        out[module] = (a, sd[f"{module}.lora_B.weight"])
    return out


def transformer_to_kohya(family, pairs, rank, alpha, rules=None):
    """{diffusers module: (A, B)} -> kohya tensors by the family's rules (or `rules`: its `comfyui_rules`)."""
    groups: dict[str, tuple[int, dict[int, tuple]]] = {}
    if dropped := sorted(m for m in pairs if re.fullmatch(layout(family).drop or "(?!)", m)):
        warnings.warn(f"{family}: kohya file leaves out {dropped} (no such module in sd-scripts' {family} LoRA)")
        pairs = {m: ab for m, ab in pairs.items() if m not in dropped}
    for module, ab in pairs.items():
        for pattern, name, size in rules or layout(family).rules:
            m = re.fullmatch(pattern, module)
            if m:
                slot = RULE_SLOTS[m.group(2)] if size > 1 else 0
                groups.setdefault(name.format(*m.groups()[:1]), (size, {}))[1][slot] = ab
                break
        else:
            raise ValueError(f"{family}: no kohya name for LoRA module {module!r}")

    out = {}
    for name, (size, slots) in groups.items():
        if size == 1:
            (down, up), a = slots[0], alpha
        else:
            # Fuse into the checkpoint's single Linear, exactly: down = [A_q; A_k; A_v(; A_mlp)] stacked
            # (size*rank x in), up = block-diagonal diag(B_q, B_k, B_v(, B_mlp)) (sum(out) x size*rank), so
            # up @ down = [B_q A_q; B_k A_k; ...] with no cross terms. The rank is now size*rank, so alpha is
            # scaled by size to keep alpha/rank (as sd-scripts does, kohya-ss/sd-scripts#2204). Untrained
            # slots get zeros, which keeps the block structure diffusers' converter detects as "sparse".
            i0, (a0, b0) = next(iter(slots.items()))
            unit = b0.shape[0] // _SLOT_WIDTH[i0]
            parts = [slots.get(i) or (a0.new_zeros(a0.shape), b0.new_zeros(unit * _SLOT_WIDTH[i], rank))
                     for i in range(size)]
            down = torch.cat([p[0] for p in parts])
            up = torch.block_diag(*[p[1] for p in parts])
            a = alpha * size
        out[f"lora_unet_{name}.lora_down.weight"] = down.contiguous()
        out[f"lora_unet_{name}.lora_up.weight"] = up.contiguous()
        out[f"lora_unet_{name}.alpha"] = torch.tensor(float(a))
    return out


def _sgm_name(key: str) -> str | None:
    """diffusers UNet attention-block name -> SGM (`input_blocks`/`middle_block`/`output_blocks`) name.
    SDXL's UNet has layers_per_block 2, so an input block spans 3 SGM indices (2 layers + downsampler)."""
    if m := re.match(r"lora_unet_down_blocks_(\d+)_attentions_(\d+)_(.*)", key):
        return f"lora_unet_input_blocks_{1 + 3 * int(m[1]) + int(m[2])}_1_{m[3]}"
    if m := re.match(r"lora_unet_up_blocks_(\d+)_attentions_(\d+)_(.*)", key):
        return f"lora_unet_output_blocks_{3 * int(m[1]) + int(m[2])}_1_{m[3]}"
    if m := re.match(r"lora_unet_mid_block_attentions_0_(.*)", key):
        return f"lora_unet_middle_block_1_{m[1]}"
    return None


def _unet_to_kohya(family, peft_state_dict, alpha):
    out = state_dict_utils.convert_state_dict_to_kohya({f"unet.{k}": v for k, v in peft_state_dict.items()})
    # diffusers writes alpha = rank (scale 1), right only when alpha == rank: store the trained alpha.
    out = {k: torch.tensor(float(alpha)) if k.endswith(".alpha") else v.contiguous() for k, v in out.items()}
    if family is not None and layout(family).sgm_blocks:  # None: diffusers' names, one module at a time
        sgm = {k: _sgm_name(k) for k in out}
        # Only attention blocks are renamed; with any other module (resnets, conv_in, ...) keep diffusers
        # names throughout, because diffusers drops the SGM keys of a file that mixes both namings.
        if all(sgm.values()):
            out = {sgm[k]: v for k, v in out.items()}
    return out


def _unet_kohya_names(family, pairs, alpha) -> dict[str, list[str]]:
    """kohya module -> [the UNet module it is]: diffusers' converter renames keys one by one, so each module's
    name is that of a one-module file, with the SGM renaming decided on the whole set as `_unet_to_kohya` does."""
    names = {}
    for module, (a, b) in pairs.items():
        one = _unet_to_kohya(None, {f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": b}, alpha)
        names[next(k for k in one if k.endswith(".lora_down.weight")).split(".")[0]] = module
    if layout(family).sgm_blocks and all(_sgm_name(k) for k in names):
        names = {_sgm_name(k): m for k, m in names.items()}
    return {k: [m] for k, m in names.items()}


def named_to_kohya(pairs, alpha, prefix="lora_unet"):
    out = {}
    for module, (down, up) in pairs.items():
        name = f"{prefix}_" + module.replace(".", "_")
        out[f"{name}.lora_down.weight"] = down.contiguous()
        out[f"{name}.lora_up.weight"] = up.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


def to_kohya(family: str, peft_state_dict: dict[str, torch.Tensor], rank: int, alpha: float,
             text_encoders: dict[str, dict[str, torch.Tensor]] | None = None, base=None) -> dict[str, torch.Tensor]:
    """`get_peft_model_state_dict(denoiser)` of a `LoraConfig(r=rank, lora_alpha=alpha)` -> kohya state dict.
    `text_encoders`: {pipeline component: its peft state dict} (train.text_encoder_lr, same rank and alpha).
    DoRA (`lora_magnitude_vector` keys): `base(module) -> its frozen weight` gives each module's `dora_scale`."""
    check_family(family)
    peft_state_dict, magnitudes = split_dora(peft_state_dict)
    pairs = lora_pairs(peft_state_dict, rank)  # validates keys and ranks for every family
    names = layout(family).names
    if names == "unet":
        out = _unet_to_kohya(family, peft_state_dict, alpha)
    elif names == "named":
        out = named_to_kohya(pairs, alpha)
    else:
        out = transformer_to_kohya(family, pairs, rank, alpha)
    if magnitudes:
        rows = (_unet_kohya_names(family, pairs, alpha) if names == "unet" else
                {"lora_unet_" + m.replace(".", "_"): [m] for m in pairs} if names == "named" else
                {"lora_unet_" + k: v for k, v in kohya_rows(family, pairs).items()})
        out.update(dora_scales(out, rows, pairs, magnitudes, alpha / rank, base, family))
    for component, state_dict in (text_encoders or {}).items():
        prefix = dict(layout(family).text_encoder_prefixes).get(component)
        if prefix is None:
            raise ValueError(f"{family}: no kohya name for a LoRA on {component}")
        out.update(named_to_kohya(lora_pairs(state_dict, rank), alpha, prefix))  # transformers' names, "." -> "_"
    return out


def base_model_version(family: str) -> str:
    """sd-scripts' `ss_base_model_version` of the family (`sdxl_base_v1-0`, `flux1`, ...)."""
    return layout(family).base_version


def kohya_metadata(family: str, rank: int, alpha: float, **info) -> dict[str, str]:
    """sd-scripts style `ss_*` metadata (safetensors metadata values must be strings)."""
    module, version = layout(family).network_module, layout(family).base_version
    meta = {"ss_network_module": module, "ss_base_model_version": version}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list, tuple)) else str(v)
                 for k, v in info.items()})
    # These describe the tensors in the file, so `info` cannot override them.
    meta.update({"ss_network_dim": str(int(rank)), "ss_network_alpha": str(float(alpha))})
    return meta


def save_kohya(path, family, peft_state_dict, rank, alpha, metadata: dict[str, str], text_encoders=None,
               base=None) -> Path:
    """Write `to_kohya(...)` with `metadata` to `path` atomically."""
    return _write(path, to_kohya(family, peft_state_dict, rank, alpha, text_encoders, base), metadata)


def bake_alpha(state_dict: dict[str, torch.Tensor], metadata: dict[str, str]):
    """A diffusers (PEFT-layout) LoRA file's tensors and metadata -> the same LoRA with its scale
    (lora_alpha / r, or / sqrt(r) with rslora) multiplied into every lora_B, and lora_alpha = r, rslora off.
    ComfyUI reads no `lora_adapter_metadata` and applies PEFT keys at scale 1; diffusers reads the metadata
    and now also gets scale 1, so both give the trained delta."""
    adapters = json.loads(metadata[LORA_META])
    out_meta, scale = dict(metadata), {}
    for key in [k for k in adapters if k.endswith(".r")]:
        prefix = key[: -len("r")]
        if adapters.get(prefix + "rank_pattern") or adapters.get(prefix + "alpha_pattern"):
            raise ValueError(f"{prefix}: per-module rank/alpha patterns are not supported")
        r, a = adapters[prefix + "r"], adapters[prefix + "lora_alpha"]
        scale[prefix] = a / (r ** 0.5 if adapters.get(prefix + "use_rslora") else r)
        adapters.update({prefix + "lora_alpha": r, prefix + "use_rslora": False})
        out_meta[f"loraflow_{prefix}trained_alpha"] = str(float(a))
    out = {}
    for k, v in state_dict.items():
        if ".lora_B." in k:
            s = scale[k.split(".", 1)[0] + "."]  # `<component>.` prefix, as diffusers writes it
            v = (v.double() * s).to(v.dtype)
        out[k] = v.contiguous()
    out_meta[LORA_META] = json.dumps(adapters, indent=2, sort_keys=True)
    return out, out_meta


def save_diffusers(path, src) -> Path:
    """The diffusers file `src` with its alpha baked in (`bake_alpha`), written atomically to `path`."""
    with safetensors.safe_open(str(src), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    return _write(path, *bake_alpha(tensors, metadata))


def write_safetensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """`_write` for the LoRA tools (tasks/lora_tools): their files are written the same atomic, canonical way."""
    return _write(path, tensors, metadata)


def _write(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Atomic, canonical write: a crash leaves the old file or the new one, never a truncated file that a UI
    would try to load; the same tensors and metadata give the same bytes."""
    path = Path(path)
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"safetensors metadata must be str -> str: {bad}")
    tensors = {k: v.detach().cpu() for k, v in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # same dir: os.replace must not cross fs
    try:
        st.save_file(tensors, str(tmp), metadata=dict(metadata))
        canonicalize_safetensors(tmp)  # safetensors orders metadata by hash: fix the bytes
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path
