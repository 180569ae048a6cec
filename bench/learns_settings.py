"""The learning check's settings (bench/learns.py): every family's tiny models as each declares them (LEARNS in its
tiny builder's module, tasks/models/tiny/), and the rows here that check a training feature on one family's model
(`<model>+<option>`), each choice's measured reason beside it."""
from __future__ import annotations

import importlib


def declared() -> dict[str, dict]:
    """{tiny model: settings} of every family in the registry (tasks/models/__init__.py), from its builder module."""
    from tasks.models import FAMILIES

    out: dict[str, dict] = {}
    for _, builder in FAMILIES.values():
        out.update(getattr(importlib.import_module(builder.split(":")[0]), "LEARNS", {}))
    return out


SETTINGS: dict[str, dict] = {
    # the pretrained demo base (data/demo_base), taught one shape it has never seen: the base a wrong timestep
    # or latent convention fights (tests/test_learns_mutations.py)
    "demo_flux": {"arch": {}, "rank": 16, "steps": 300, "lr": 1e-3},
    **declared(),
}
# `<model>+<network>`: the same run with train.network (LoHa/LoKr: their LyCORIS file, put on the model as
# ComfyUI merges it, tasks/models/lora_variants/lycoris.py apply_lycoris). At the LoRA's lr 1e-3 neither reaches the bound
# in 300 steps (measured ratios 0.84 LoKr, 0.19 LoHa): peft starts one factor of each at zero and the other's
# products are small, so they take the larger lr LyCORIS' guides give (LoKr 1e-2: 0.073; LoHa 3e-3: 0.028).
# `<model>+int8|nf4`: trained on a quantized base (model.quantize, QLoRA), the files rendered on the full base
SETTINGS["tiny_flux+int8"] = {**SETTINGS["tiny_flux"], "quantize": "int8"}
SETTINGS["tiny_flux+nf4"] = {**SETTINGS["tiny_flux"], "quantize": "nf4"}
SETTINGS["tiny_qwenimage+nf4"] = {**SETTINGS["tiny_qwenimage"], "quantize": "nf4"}
SETTINGS["tiny_sd15+int8"] = {**SETTINGS["tiny_sd15"], "quantize": "int8"}  # its attention Linears (convs stay)
# model.matmul=w8a8 (tasks/training/w8a8.py): the activations quantized per token as well (issue 45)
SETTINGS["tiny_flux+int8+w8a8"] = {**SETTINGS["tiny_flux"], "quantize": "int8", "matmul": "w8a8"}
SETTINGS["tiny_flux+fp8+w8a8"] = {**SETTINGS["tiny_flux"], "quantize": "fp8", "matmul": "w8a8"}
SETTINGS["tiny_flux+lokr"] = {**SETTINGS["tiny_flux"], "network": "lokr", "lr": 1e-2}
SETTINGS["tiny_flux+loha"] = {**SETTINGS["tiny_flux"], "network": "loha", "lr": 3e-3}
