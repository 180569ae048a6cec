"""Training checkpoints in the store: LoRA weights, the optimizer's tensor state, the EMA of the LoRA weights
(train.ema_decay) and the torch RNG state as safetensors (no pickle); the losses so far, the samples rendered
so far, the fp16 loss scaler's state (its scale and growth tracker: without them a resumed fp16 run starts
again from the initial scale) and the optimizer's plain numbers as JSON metadata: per-parameter ones (a
Python int step) and per-group ones (Prodigy's d, d_max, d_numerator, k ...), which a float32 tensor would
round.

A checkpoint is keyed by the training *trajectory* (every input that shapes steps 1..k, tasks/train.py)
and its step, so a run whose max_steps grew, or one that was killed, continues from the latest one."""
from __future__ import annotations

import logging
import math

from tasks.store.hashing import key_of
from tasks.lazy import lazy
from tasks.store import Store
from tasks.training.sharding import assign, full, like

torch = lazy("torch")

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


# The schedule sets the learning rate at every step (and after a resume); it is not restored.
_SCHEDULED = ("params", "lr", "initial_lr")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def save_checkpoint(store: Store, key: str, step: int, named: dict, optimizer, step_losses: list[float],
                    samples: dict, scaler=None, ema=None, validation_loss: list[dict] | None = None,
                    write: bool = True) -> None:
    """With train.shard=fsdp every process calls it (the whole tensors are gathered, a collective) and the
    one with `write` stores them."""
    tensors, numbers = {"rng/torch": torch.get_rng_state()}, {}
    for name, p in named.items():
        tensors[f"lora/{name}"] = full(p.detach()).clone()
        for k, v in optimizer.state.get(p, {}).items():
            if torch.is_tensor(v):
                tensors[f"adam/{name}/{k}"] = full(v.detach()).clone()
            elif _number(v):  # a Python number stays one (an int step, a float: exact in JSON)
                numbers.setdefault(name, {})[k] = v
        if ema is not None:
            tensors[f"ema/{name}"] = full(ema[name].detach()).clone()
    if not write:
        return
    meta = {"step": step, "losses": step_losses, "samples": samples}
    if validation_loss is not None:  # data.validation_split: the curve so far, for a resumed run's report
        meta["validation_loss"] = validation_loss
    if scaler is not None and scaler.is_enabled():
        meta["loss_scaler"] = scaler.state_dict()  # plain numbers: scale, growth factors, tracker
    if numbers:
        meta["optimizer_numbers"] = numbers
    meta["optimizer_groups"] = [{k: v for k, v in g.items() if k not in _SCHEDULED and _number(v)}
                                for g in optimizer.param_groups]
    store.put_tensors(KIND, key, tensors, meta=meta)


def load_checkpoint(store: Store, key: str, named: dict, optimizer, scaler=None, ema=None) -> dict:
    """Restores the LoRA weights, optimizer state, EMA weights, RNG state and loss scaler in place; returns
    the metadata."""
    tensors = store.get_tensors(KIND, key)
    meta = store.meta(KIND, key)
    numbers = meta.get("optimizer_numbers", {})
    with torch.no_grad():
        for name, p in named.items():
            assign(p, tensors[f"lora/{name}"])  # (sharded: each process keeps its shard of the whole tensor)
            # moments follow the parameter's device (and sharding); the step count stays a CPU scalar, as AdamW
            # keeps it
            state = {k.rsplit("/", 1)[1]: like(p, v) for k, v in tensors.items() if k.startswith(f"adam/{name}/")}
            state.update(numbers.get(name, {}))
            if state:
                optimizer.state[p] = state
            if ema is not None:
                assign(ema[name], tensors[f"ema/{name}"])
    for group, saved in zip(optimizer.param_groups, meta.get("optimizer_groups", [])):
        group.update(saved)
    torch.set_rng_state(tensors["rng/torch"])
    if scaler is not None and scaler.is_enabled() and meta.get("loss_scaler"):
        scaler.load_state_dict(meta["loss_scaler"])
    return meta
