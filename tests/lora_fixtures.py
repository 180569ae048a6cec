"""A trained-looking PEFT LoRA on a denoiser: peft starts lora_B at zero, so B is drawn here (seeded, x 0.1),
as the key-map, export and LoRA-tool tests need a non-zero delta."""
from __future__ import annotations

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict


def random_lora(den: torch.nn.Module, targets, rank: int, alpha: float, seed: int = 1) -> tuple[dict, LoraConfig]:
    """Adds the adapter to `den` and returns (its PEFT state dict, its config)."""
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets)
    den.add_adapter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in den.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return get_peft_model_state_dict(den), config


def factors_and_deltas(sd: dict, rank: int, alpha: float, prefix: str = "transformer") -> tuple[dict, dict]:
    """({prefix.module: (A, B, alpha / rank)}, {prefix.module: float64 delta}) of a PEFT state dict."""
    factors = {f"{prefix}.{k[: -len('.lora_A.weight')]}": (v, sd[k.replace("lora_A", "lora_B")], alpha / rank)
               for k, v in sd.items() if k.endswith(".lora_A.weight")}
    return factors, {m: s * (b.double() @ a.double()) for m, (a, b, s) in factors.items()}
