"""Per-item bookkeeping shared by the nodes: which item keys are in the store, valid, or need work."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tasks.store import Store

log = logging.getLogger("loraflow")


@dataclass
class ItemStatus:
    missing: list[str] = field(default_factory=list)  # distinct keys to compute
    reused: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)  # keys whose stored entry failed verification


def check_items(store: Store, kind: str, keys) -> ItemStatus:
    """Sort distinct keys into reused / missing; a stored entry that fails verification is discarded,
    logged, and recomputed (listed as repaired)."""
    status = ItemStatus()
    for key in dict.fromkeys(keys):
        if not store.exists(kind, key):
            status.missing.append(key)
        elif store.valid(kind, key):
            status.reused.append(key)
        else:
            log.warning("%s item %s failed verification: recomputing it", kind, key[:12])
            store.discard(kind, key)
            status.repaired.append(key)
            status.missing.append(key)
    return status


def chunks(seq: list, n: int):
    for i in range(0, len(seq), n):
        yield seq[i:i + n]


def node_result(key: str, items: dict[str, str], status: ItemStatus, inputs: dict, **extra) -> dict:
    """The small JSON a node returns to the flow (Prefect persists this, never tensors)."""
    return {"key": key, "items": items, "computed": len(status.missing), "reused": len(status.reused),
            "repaired": status.repaired, "inputs": inputs, **extra}
