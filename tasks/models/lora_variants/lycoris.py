"""LoHa and LoKr (`train.network=loha|lokr`) on a model: peft's own `LoHaConfig` / `LoKrConfig`, the train node's
file of them, and putting a file back on a model for sampling.

- The train node's file: peft's state dict under the pipeline component's prefix (`transformer.<module>.hada_w1_a`,
  `unet.<module>.lokr_w1`) with the peft config in `lora_adapter_metadata`, as diffusers writes a LoRA. diffusers'
  `load_lora_weights` reads no LoHa/LoKr (FLUX.2's reads LoKr), so `apply_file` puts it on the model with peft
  (inject + state dict): the sample node and samples during training render through that.
- The exported LyCORIS file (tasks/training/export_lycoris.py) goes back on a model by `apply_lycoris`, as
  ComfyUI's rules merge it: the learning check renders through that. A file in a family's ComfyUI names says in
  its metadata which diffusers Linears each module is; a fused module (LoHa, LoKr) is split back exactly.
- `share_w2`: the LoKr of Linears that the LyCORIS file fuses into one module train with one w2 (a Kronecker
  product of the fused Linear; tasks/training/lycoris_fused.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from tasks.config_schema import TrainConfig
from tasks.lazy import lazy

torch = lazy("torch")
peft = lazy("peft")

NETWORKS = ("loha", "lokr")
SUFFIXES = {"loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
            "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")}
LORA_META = "lora_adapter_metadata"
ROWS_META = "loraflow_lycoris_rows"  # an exported file's {module: [diffusers Linear of each row block, or null]}


def is_lycoris(tc: TrainConfig) -> bool:
    return tc.network in NETWORKS


def make_config(network: str, rank: int, alpha: float, targets):
    """peft's config for `network`: the same rank, alpha and targets as the plain LoRA; peft's default init
    (one factor zero, so training starts from the base model)."""
    cls = {"loha": peft.LoHaConfig, "lokr": peft.LoKrConfig}[network]
    return cls(r=rank, alpha=alpha, target_modules=targets)


def file_kind(config: dict) -> str:
    """"loha" / "lokr" for a peft config dict of those networks, "" for a LoRA."""
    return network_of(config)


def network_of(config: dict) -> str:
    kind = str(config.get("peft_type", "")).rsplit(".", 1)[-1].upper()
    return {"LOHA": "loha", "LOKR": "lokr"}.get(kind, "")


def file_network(path) -> str:
    """"loha" / "lokr" for a train-node file of those networks, "" for anything else (a plain LoRA)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = (f.metadata() or {}).get(LORA_META)
    if not meta:
        return ""
    kinds = {network_of({"peft_type": v}) for k, v in json.loads(meta).items() if k.endswith(".peft_type")}
    return next(iter(kinds - {""}), "")


def save_peft(path, state_dict: dict, config: dict, component: str):
    """The train node's file: peft's state dict and config under `component` (diffusers' LoRA file shape),
    written into the node's temporary folder (the node canonicalises and stores it)."""
    from safetensors.torch import save_file

    # cloned: LoKr layers sharing w2 (share_w2) would otherwise share memory, which safetensors refuses
    tensors = {f"{component}.{k}": v.detach().clone().contiguous() for k, v in state_dict.items()}
    meta = {LORA_META: json.dumps({f"{component}.{k}": v for k, v in config.items()}, indent=2, sort_keys=True,
                                  default=str), "format": "pt"}
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # as diffusers' save_lora_weights makes its folder
    save_file(tensors, str(path), metadata=meta)
    return Path(path)


def read_peft(path) -> tuple[dict, dict, str]:
    """A `save_peft` file -> (state dict without the prefix, config dict, component)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()[LORA_META])
    components = {k.split(".", 1)[0] for k in tensors}
    if len(components) != 1:
        raise ValueError(f"{path}: a LoHa/LoKr file of one component, found {sorted(components)}")
    component = components.pop()
    cut = len(component) + 1
    config = {k[cut:]: v for k, v in meta.items() if k.startswith(component + ".")}
    return {k[cut:]: v for k, v in tensors.items()}, config, component


def apply_file(model, path) -> None:
    """Put a `save_peft` file's LoHa/LoKr on `model` (peft inject + load). Every tensor must land: a key the
    model has no module for is an error, not a silently weaker network."""
    state_dict, config, _ = read_peft(path)
    network = network_of(config)
    model.add_adapter(make_config(network, int(config["r"]), float(config["alpha"]), config["target_modules"]))
    result = peft.set_peft_model_state_dict(model, state_dict)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(f"{path}: {len(unexpected)} tensor(s) match no {network} layer, e.g. {unexpected[:3]}")


def modules_of(state_dict: dict, network: str) -> dict[str, dict]:
    """peft state dict -> {module: {suffix: tensor}}; any other key is refused."""
    out: dict[str, dict] = {}
    for key, t in state_dict.items():
        module, _, suffix = key.rpartition(".")
        if suffix not in SUFFIXES[network]:
            raise ValueError(f"{key}: not a {network} tensor ({', '.join(SUFFIXES[network])})")
        out.setdefault(module, {})[suffix] = t
    return out


def is_lycoris_file(path) -> bool:
    """Whether a .safetensors file is in the LyCORIS layout of `to_lycoris` (`<module>.hada_w1_a`, `.lokr_w1`...)."""
    from safetensors import safe_open

    suffixes = {s for sfx in SUFFIXES.values() for s in sfx}
    with safe_open(str(path), "pt") as f:
        return any(k.rpartition(".")[2] in suffixes for k in f.keys())


def share_w2(model, groups: list[list[str]]) -> int:
    """Each group's LoKr layers (after add_adapter) take the first one's w2 Parameters (`lokr_w2`, or
    `lokr_w2_a` and `lokr_w2_b`): one tensor, its gradients from every layer adding up. Returns how many."""
    modules, tied = dict(model.named_modules()), 0
    for group in groups:
        first = modules[group[0]]
        for name in group[1:]:
            layer = modules[name]
            for attr in ("lokr_w2", "lokr_w2_a", "lokr_w2_b"):
                for adapter, p in getattr(first, attr).items():
                    if getattr(layer, attr)[adapter].shape != p.shape:
                        raise ValueError(f"{name}: its LoKr {attr} is {tuple(getattr(layer, attr)[adapter].shape)}, "
                                         f"{group[0]}'s {tuple(p.shape)}: no shared w2")
                    getattr(layer, attr)[adapter] = p
                    tied += 1
    return tied


def split_fused(network: str, parts: dict, widths: list[int]) -> list[dict]:
    """A fused module's parts (scale folded in, no alpha: tasks/training/lycoris_fused.py) -> each row block's
    (`widths`: their output rows), exactly: LoHa's block-diagonal w1a/w2a cut into blocks (anything off them
    refused), LoKr's stacked w1 cut by rows beside the shared w2."""
    n = len(widths)
    if network == "lokr":
        w1 = parts["lokr_w1"] if "lokr_w1" in parts else parts["lokr_w1_a"] @ parts["lokr_w1_b"]
        w2 = {k: v for k, v in parts.items() if k.startswith("lokr_w2")}
        return [{"lokr_w1": w, **w2} for w in w1.chunk(n)]
    r = parts["hada_w1_b"].shape[0] // n
    out = [{} for _ in widths]
    for i in (1, 2):
        a, b = parts[f"hada_w{i}_a"], parts[f"hada_w{i}_b"]
        blocks = [a[sum(widths[:j]):sum(widths[:j + 1]), j * r:(j + 1) * r] for j in range(n)]
        if not torch.equal(torch.block_diag(*blocks), a):
            raise ValueError(f"hada_w{i}_a of a fused module is not block-diagonal: not loraflow's fused LoHa")
        for j in range(n):
            out[j].update({f"hada_w{i}_a": blocks[j], f"hada_w{i}_b": b[j * r:(j + 1) * r]})
    return out


def apply_lycoris(model, path) -> None:
    """Put an exported LyCORIS file on `model` as ComfyUI's LoHa/LoKr rules merge it (scale alpha / rank where
    the factor is low-rank, 1 where LoKr's are both full), through peft: the loader the learning check and the
    tests use to see that the exported file is the trained network."""
    import re

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    rows = json.loads(meta[ROWS_META]) if ROWS_META in meta else {"lycoris_" + n.replace(".", "_"): [n] for n in linears}
    groups: dict[str, dict] = {}
    for key, t in tensors.items():
        lyco, _, suffix = key.rpartition(".")
        if lyco not in rows or not set(filter(None, rows[lyco])) <= linears.keys():
            raise ValueError(f"{path}: {key} names no Linear of {type(model).__name__}")
        groups.setdefault(lyco, {})[suffix] = t.float()
    kinds = {n for n, sfx in SUFFIXES.items() for parts in groups.values() if set(parts) & set(sfx)}
    if len(kinds) != 1:
        raise ValueError(f"{path}: expected LoHa or LoKr tensors, found {sorted(kinds) or 'neither'}")
    network = kinds.pop()
    rank = int(float(meta.get("ss_network_dim", 0))) or max(
        p[s].shape[0] for p in groups.values() for s in ("hada_w1_b", "lokr_w2_b", "lokr_w1_b") if s in p)
    state = {}
    for lyco, parts in groups.items():
        alpha = parts.pop("alpha", None)
        if network == "loha":
            scale = float(alpha) / parts["hada_w1_b"].shape[0] if alpha is not None else 1.0
            parts["hada_w1_a"] = parts["hada_w1_a"] * scale
        else:
            dim = next((parts[s].shape[0] for s in ("lokr_w2_b", "lokr_w1_b") if s in parts), None)
            scale = float(alpha) / dim if alpha is not None and dim is not None else 1.0
            first = "lokr_w1" if "lokr_w1" in parts else "lokr_w1_a"
            parts[first] = parts[first] * scale
        slots = rows[lyco]
        width = next(linears[m].out_features for m in slots if m)  # a slot not trained: zeros of this width
        split = [parts] if len(slots) == 1 else split_fused(
            network, parts, [linears[m].out_features if m else width for m in slots])
        for module, one in zip(slots, split):
            if module:  # a slot not trained: zeros
                state.update({f"{module}.{s}": t for s, t in one.items()})
    trained = sorted({k.rsplit(".", 1)[0] for k in state})
    targets = "^(" + "|".join(re.escape(m) for m in trained) + ")$"
    model.add_adapter(make_config(network, rank, rank, targets))  # scale 1: ComfyUI's scale is in the factors
    result = peft.set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(f"{path}: {len(unexpected)} tensor(s) do not fit peft's {network} layers, e.g. {unexpected[:3]}")
