"""Module names across the two layouts, read from the family's own diffusers class: no table of names is kept here.

kohya has one module per ORIGINAL-checkpoint Linear (Flux's fused `double_blocks_0_img_attn_qkv`), diffusers one
per diffusers Linear (`transformer_blocks.0.attn.to_q`). export.py maps one way (to_kohya, kohya_rows); the way
back needs the list of the denoiser's Linears and their widths: the base model's own when there is one (its
weights, or its config built on the meta device), else the class's defaults widened to the largest released
variant (a smaller model's names are a subset), built on the meta device (no memory, no weights; FLUX.1's 57
blocks in about 2 s)."""
from __future__ import annotations

import functools
import json
import warnings

from tasks.lazy import lazy
from tasks.lora_tools.lora_files import LoraToolError, Pair
from tasks.training.export import kohya_rows, layout, to_kohya

torch = lazy("torch")



def denoiser_component(family: str) -> str:
    """The diffusers LoRA keys' prefix: the pipeline folder's denoiser subfolder (Wan 2.2: `transformer` for
    either expert's file)."""
    from tasks.models import adapter_class

    cls = adapter_class(family)
    return cls.lora_file_component or cls.denoiser_subfolder


def linear_shapes(family: str | None, config: dict | None = None) -> dict[str, tuple[int, int]]:
    """{Linear module name: (out, in)} of the family's denoiser, from `config` (a config.json) or the widest
    defaults, built on the meta device."""
    return _linear_shapes(family, json.dumps(config, sort_keys=True) if config else None)


@functools.lru_cache(maxsize=8)  # a merge converts each input: build each layout once
def _linear_shapes(family: str | None, config_json: str | None) -> dict[str, tuple[int, int]]:
    import diffusers

    from tasks.models import adapter_class

    config = json.loads(config_json) if config_json else None
    # a folder's config names its class (sd15 and sdxl share UNet2DConditionModel, and the family may be unknown)
    cls = getattr(diffusers, str(config.get("_class_name")), None) if config else adapter_class(family).denoiser_cls
    if not isinstance(cls, type):
        raise LoraToolError(f"the model's config.json names no diffusers model class ({config.get('_class_name')!r})")
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")  # diffusers' notes on config keys it does not use
        model = cls.from_config(config) if config else cls(**adapter_class(family).widest_arch)
    return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def weight_shapes(state_dict: dict) -> dict[str, tuple[int, int]]:
    """{module: (out, in)} of every 2-d `.weight` of a denoiser's state dict (a LoRA can only target those)."""
    return {k[: -len(".weight")]: tuple(v.shape) for k, v in state_dict.items()
            if k.endswith(".weight") and v.ndim == 2}


def _fuses(family: str) -> bool:
    """Whether export.py maps this family through kohya_rows (kohya modules that fuse several diffusers Linears):
    the family declares rules (its adapter's KohyaLayout)."""
    return layout(family).names == "rules"


def kohya_groups(family: str, shapes) -> dict[str, list[str]]:
    """kohya module (`lora_unet_...`) -> the diffusers Linears that are its row blocks, in order."""
    if _fuses(family):
        return {f"lora_unet_{k}": rows for k, rows in kohya_rows(family, shapes).items()}
    # One Linear per module: to_kohya names each alone. A family named by SGM blocks (SDXL) has two kohya names
    # for its attention modules: SGM's (`input_blocks_4_1_...`) and, in a file that also has other modules,
    # diffusers' (export._unet_to_kohya), which the UNet rule without SGM blocks (sd15's) gives.
    z, groups = torch.zeros(1, 1), {}
    for name in shapes:
        for fam in (family, "sd15") if layout(family).sgm_blocks else (family,):
            keys = to_kohya(fam, {f"{name}.lora_A.weight": z, f"{name}.lora_B.weight": z}, 1, 1.0)
            kohya = next(k for k in keys if k.endswith(".lora_down.weight"))[: -len(".lora_down.weight")]
            groups.setdefault(kohya, [name])
    return groups


def kohya_to_diffusers(modules: dict, family: str, shapes, exact: bool, what: str) -> dict:
    """kohya modules -> diffusers ones: a fused module's up is split by rows (its down is shared), exactly.
    Columns of up that are all zero in a row block (to_kohya's block-diagonal fusing, or padding) add nothing and
    are dropped, so loraflow's own files come back at their trained rank. `exact`: `shapes` are the base model's,
    so widths must match; otherwise they are the widest defaults' and only their ratios are used."""
    groups, component, out = kohya_groups(family, shapes), denoiser_component(family), {}
    for name, p in modules.items():
        if name.startswith("lora_te"):
            raise LoraToolError(f"{what}: {name} is a text-encoder module; converting those to the diffusers layout "
                                "is not done (keep --format kohya)")
        rows = groups.get(name)
        if rows is None:
            raise LoraToolError(f"{what}: {name} names no Linear of {family}'s denoiser: is the family right "
                                "(--family)?")
        widths, n = [shapes[r][0] for r in rows], p.up.shape[0]
        if sum(widths) != n and (exact or any(n * w % sum(widths) for w in widths)):
            raise LoraToolError(f"{what}: {name} has {n} output rows but {family}'s {' + '.join(rows)} have "
                                f"{sum(widths)}: a LoRA of another model (check --family / the base model)?")
        if exact and shapes[rows[0]][1] != p.down.shape[1]:
            raise LoraToolError(f"{what}: {name} takes {p.down.shape[1]} inputs, the base model's {rows[0]} "
                                f"{shapes[rows[0]][1]}: a LoRA of another model?")
        widths = [n * w // sum(widths) for w in widths]
        start = 0
        for row, width in zip(rows, widths):
            up = p.up[start:start + width]
            start += width
            cols = (up != 0).any(0)
            if not cols.any():  # an untrained slot of a fused module
                continue
            key = f"{component}.{row}"
            if key in out:
                raise LoraToolError(f"{what}: two kohya modules name {row} (SGM and diffusers names at once?)")
            out[key] = Pair(p.down[cols], up[:, cols], p.scale * int(cols.sum()))
    return out


def diffusers_to_kohya(modules: dict, family: str, shapes, what: str) -> tuple[dict, list[str]]:
    """diffusers modules -> kohya ones through export.to_kohya (fusing, SGM names, text encoders), exactly: each
    scale is folded into up and ranks are zero-padded to the largest (to_kohya takes one rank and one alpha;
    zero rows and columns add nothing). Returns the modules and to_kohya's warnings (modules it leaves out)."""
    component, denoiser, text = denoiser_component(family), {}, {}
    for name, p in modules.items():
        part, rest = name.split(".", 1)
        if part == component and rest in shapes:
            denoiser[rest] = p
        elif part.startswith("text_encoder"):
            text.setdefault(part, {})[rest] = p
        else:
            raise LoraToolError(f"{what}: {name} is no Linear of {family}'s denoiser ({component}): is the "
                                "family right (--family)?")
    rank = max(p.rank for p in modules.values())

    def peft(part: dict) -> dict:
        out = {}
        for m, p in part.items():
            pad = rank - p.rank
            out[f"{m}.lora_A.weight"] = torch.nn.functional.pad(p.down, (0, 0, 0, pad))
            out[f"{m}.lora_B.weight"] = torch.nn.functional.pad((p.up.double() * p.scale).to(p.up.dtype), (0, pad))
        return out

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tensors = to_kohya(family, peft(denoiser), rank, float(rank), {c: peft(s) for c, s in text.items()})
        except ValueError as e:
            raise LoraToolError(f"{what}: {e}") from None
    names = [k[: -len(".lora_down.weight")] for k in tensors if k.endswith(".lora_down.weight")]
    out = {n: Pair(tensors[f"{n}.lora_down.weight"], tensors[f"{n}.lora_up.weight"],
                   float(tensors[f"{n}.alpha"].item())) for n in names}
    return out, [str(w.message) for w in caught]
