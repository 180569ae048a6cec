"""DoRA in the kohya/ComfyUI layouts: each module's `dora_scale`, from PEFT's magnitude and the base weight
(tasks/training/export.py writes them beside the LoRA pairs). Pure core: torch only."""
from __future__ import annotations

from tasks.lazy import lazy

torch = lazy("torch")


def split_dora(sd: dict) -> tuple[dict, dict]:
    """(the plain LoRA keys, {module: DoRA magnitude (out,)})."""
    tail = ".lora_magnitude_vector"
    return ({k: v for k, v in sd.items() if not k.endswith(tail)},
            {k[: -len(tail)]: v for k, v in sd.items() if k.endswith(tail)})


def dora_scales(out: dict, rows: dict[str, list[str]], pairs: dict, magnitudes: dict, scale: float, base,
                family: str) -> dict[str, torch.Tensor]:
    """`<kohya module>.dora_scale` for ComfyUI's DoRA rule (comfy/weight_adapter/base.py weight_decompose, v0.3.77:
    a dora_scale of shape (out, 1) is on the output axis, and there it computes W' = (W + dW) * dora_scale /
    (|W_row| + eps), the norm of the BASE weight's rows). PEFT trains W' = (W + dW) * m / |(W + dW)_row|, so
    dora_scale = m * (|W_row| + eps) / |(W + dW)_row|, eps of float32; rows of a fused module are its slots' rows
    (the norm is per row, so fusing keeps it exact)."""
    if base is None:
        raise ValueError("a DoRA LoRA's kohya/ComfyUI file needs the base model's weights (its dora_scale)")
    eps = torch.finfo(torch.float32).eps
    result = {}
    for name, modules in rows.items():
        if f"{name}.lora_down.weight" not in out:
            continue
        if any(m not in magnitudes for m in modules):
            raise ValueError(f"{family}: {name} mixes DoRA and plain modules")
        size = out[f"{name}.lora_up.weight"].shape[0]
        parts = []
        for m in modules:
            w = base(m).double()
            a, b = pairs[m]
            dw = scale * (b.double() @ a.double())
            parts.append(magnitudes[m].double() * (w.norm(dim=1) + eps) / (w + dw).norm(dim=1))
        col = torch.cat(parts)
        if col.shape[0] != size:  # a fused Linear with a slot not trained: its rows would need the base too
            raise ValueError(f"{family}: DoRA on part of the fused {name} ({modules}); train all of its "
                             "projections (train.target_modules) or use export.format=diffusers")
        result[f"{name}.dora_scale"] = col.float()[:, None].contiguous()
    return result
