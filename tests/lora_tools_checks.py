"""What the loraflow-lora tests share (tests/test_lora_tools*.py): a trained-looking LoRA written as loraflow
writes it, the deltas a file holds (read with safetensors alone, independent of the tools), the rounding
bound of folding a scale into a factor, and the tools' entry point."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lora_fixtures import random_lora
from tasks.lora_tools import commands as cli
from tasks.models import adapter_class
from tasks.models.zimage import ZImageAdapter
from tasks.training.export import kohya_metadata, save_kohya

U = torch.finfo(torch.float32).eps / 2
RANK, ALPHA = 4, 3.0  # alpha/rank = 0.75; a second LoRA uses alpha 5 (1.25) and rank 2
_ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
TARGETS = {"flux": _ATTN + ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff.net.0.proj", "ff.net.2",
                            "proj_mlp", "proj_out"],
           "sd15": _ATTN, "sdxl": _ATTN,
           "zimage": ZImageAdapter.LORA_TARGETS, "qwenimage": _ATTN, "sd3": _ATTN + ["add_q_proj", "add_k_proj", "add_v_proj"],
           "flux2_klein": ["to_q", "to_k", "to_v", "to_qkv_mlp_proj", "linear_in"]}


def denoiser(family, model_dir):
    a = adapter_class(family)
    return a.denoiser_cls.from_pretrained(model_dir, subfolder=a.denoiser_subfolder)


def peft_lora(family, model_dir, out: Path, targets=None, rank=RANK, alpha=ALPHA, seed=1, kohya=True):
    """A trained-looking PEFT LoRA (PEFT starts B at zero: B drawn here) written as loraflow writes it before
    export: the diffusers file with its peft config, and (kohya=True) the kohya export. Returns (the model with
    the adapter, {diffusers module: float64 delta}, {module: (A, B, scale)})."""
    den = denoiser(family, model_dir)
    sd, config = random_lora(den, targets or TARGETS[family], rank, alpha, seed)
    a = adapter_class(family)
    a.pipeline_cls.save_lora_weights(out, **{f"{a.denoiser_subfolder}_lora_layers": sd,
                                             f"{a.denoiser_subfolder}_lora_adapter_metadata": config.to_dict()})
    if kohya:
        save_kohya(out / "lora_kohya.safetensors", family, sd, rank, alpha, kohya_metadata(family, rank, alpha))
    factors = {k[: -len(".lora_A.weight")]: (v, sd[k.replace("lora_A", "lora_B")], alpha / rank)
               for k, v in sd.items() if k.endswith(".lora_A.weight")}
    return den, {m: s * (b.double() @ a_.double()) for m, (a_, b, s) in factors.items()}, factors


def read(path) -> dict:
    """{module: (down, up, scale)} of a LoRA file, read with safetensors alone (independent of the tools)."""
    t = load_file(path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    out = {}
    for k in t:
        if k.endswith(".lora_down.weight"):
            m = k[: -len(".lora_down.weight")]
            down = t[k]
            out[m] = (down, t[f"{m}.lora_up.weight"], t[f"{m}.alpha"].item() / down.shape[0])
        elif k.endswith(".lora_A.weight"):
            m = k[: -len(".lora_A.weight")]
            c = {k2.split(".", 1)[1]: v for k2, v in json.loads(meta.get("lora_adapter_metadata", "{}")).items()
                 if k2.startswith(m.split(".")[0] + ".")}
            # the tools write scale 1 (lora_alpha = r, alpha_pattern = rank_pattern); inputs have one r and alpha
            assert c.get("alpha_pattern", {}) == c.get("rank_pattern", {})
            out[m] = (t[k], t[f"{m}.lora_B.weight"], c["lora_alpha"] / c["r"] if c and not c.get("rank_pattern")
                      else 1.0)
    return out


def deltas(path) -> dict:
    return {m: s * (up.double() @ down.double()) for m, (down, up, s) in read(path).items()}


def fold_bound(factors: dict, weights=None) -> dict:
    """u * |w s| * (|up| @ |down|) per module: what folding w*s into up (one float32 rounding) may change."""
    return {m: U * abs((weights or {}).get(m, 1.0) * s) * (b.double().abs() @ a.double().abs())
            for m, (a, b, s) in factors.items()}


def assert_deltas(actual: dict, expected: dict, bound: dict, what: str):
    assert actual.keys() == expected.keys(), f"{what}: modules {sorted(set(actual) ^ set(expected))[:6]}"
    for m in expected:
        diff = (actual[m] - expected[m]).abs()
        assert (diff <= 2 * bound[m]).all(), f"{what}: {m} off by {diff.max():.3e} (bound {bound[m].max():.3e})"


def run(*argv) -> int:
    return cli.main([str(a) for a in argv])
