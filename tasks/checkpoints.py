"""Training checkpoints in the store: LoRA weights, AdamW state and the torch RNG state as safetensors (no
pickle), the losses so far, the samples rendered so far and the fp16 loss scaler's state (its scale and
growth tracker: without them a resumed fp16 run starts again from the initial scale) as JSON metadata.

A checkpoint is keyed by the training *trajectory* (every input that shapes steps 1..k, tasks/train.py)
and its step, so a run whose max_steps grew, or one that was killed, continues from the latest one."""
from __future__ import annotations

import logging

import torch

from tasks.hashing import key_of
from tasks.store import Store

KIND = "checkpoints"
log = logging.getLogger("loraflow")


def checkpoint_key(trajectory: str, step: int) -> str:
    return key_of({"trajectory": trajectory, "step": step})


def latest_checkpoint(store: Store, trajectory: str, max_steps: int, discard: bool = True) -> int:
    """The highest step <= max_steps with a valid stored checkpoint of this trajectory (0: none). A
    checkpoint that fails verification is discarded (or, with discard=False, just skipped)."""
    for step in range(max_steps, 0, -1):
        key = checkpoint_key(trajectory, step)
        if store.exists(KIND, key):
            if store.valid(KIND, key):
                return step
            if discard:
                log.warning("train: checkpoint at step %d failed verification; discarded", step)
                store.discard(KIND, key)
    return 0


def save_checkpoint(store: Store, key: str, step: int, named: dict, optimizer, step_losses: list[float],
                    samples: dict, scaler=None, validation_loss: list[dict] | None = None) -> None:
    tensors = {"rng/torch": torch.get_rng_state()}
    for name, p in named.items():
        tensors[f"lora/{name}"] = p.detach().clone()
        for k, v in optimizer.state.get(p, {}).items():
            tensors[f"adam/{name}/{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().clone()
    meta = {"step": step, "losses": step_losses, "samples": samples}
    if validation_loss is not None:  # data.validation_split: the curve so far, for a resumed run's report
        meta["validation_loss"] = validation_loss
    if scaler is not None and scaler.is_enabled():
        meta["loss_scaler"] = scaler.state_dict()  # plain numbers: scale, growth factors, tracker
    store.put_tensors(KIND, key, tensors, meta=meta)


def load_checkpoint(store: Store, key: str, named: dict, optimizer, scaler=None) -> dict:
    """Restores the LoRA weights, optimizer state, RNG state and loss scaler in place; returns the metadata."""
    tensors = store.get_tensors(KIND, key)
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(tensors[f"lora/{name}"])
            # moments follow the parameter's device; the step count stays a CPU scalar, as AdamW keeps it
            state = {k.rsplit("/", 1)[1]: v.to(p.device) if v.dim() else v
                     for k, v in tensors.items() if k.startswith(f"adam/{name}/")}
            if state:
                optimizer.state[p] = state
    torch.set_rng_state(tensors["rng/torch"])
    meta = store.meta(KIND, key)
    if scaler is not None and scaler.is_enabled() and meta.get("loss_scaler"):
        scaler.load_state_dict(meta["loss_scaler"])
    return meta
