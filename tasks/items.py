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


def progress(iterable, desc: str, total: int | None = None):
    """A progress bar on a terminal (tqdm; off when the output is not a TTY, e.g. a worker's log)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit="item", disable=None, leave=False)


def prefetch(load, batches: list):
    """load(batch) for each batch, the next one prepared in a thread while the caller computes on this
    one: image decoding overlaps the VAE (PIL and torch release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    if not batches:
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(load, batches[0])
        for nxt in batches[1:]:
            ready, pending = pending.result(), pool.submit(load, nxt)
            yield ready
        yield pending.result()
