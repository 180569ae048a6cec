"""Per-item bookkeeping shared by the nodes: which item keys are in the store, valid, or need work."""
from __future__ import annotations

import logging
from collections import OrderedDict
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
    keys = list(dict.fromkeys(keys))
    unchanged = store.unchanged(kind, keys)  # two stat calls each for entries verified before, none read
    for key in keys:
        if key in unchanged or store.intact(kind, key):
            status.reused.append(key)
        elif not store.exists(kind, key):
            status.missing.append(key)
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


class BackgroundWrites:
    """Store writes in one thread while the caller computes the next item: an item's write waits mostly on
    the disk (fsync), which overlaps the encoder. At most `depth` writes are pending. Writes run in the
    order submitted; once one fails (a full disk, say) the later ones are skipped, and the error is raised
    in the caller's thread at its next submit or on leaving. On leaving, every write submitted has finished
    or been skipped: each entry is committed whole or not at all (debris only in the store's tmp/)."""

    def __init__(self, depth: int = 4):
        self._depth = depth

    def __enter__(self):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-write")
        self._pending, self._failed = deque(), False
        return self

    def _write(self, fn, args, kwargs):
        if self._failed:  # a write before this one failed: this one must not commit after it
            return
        try:
            fn(*args, **kwargs)
        except BaseException:
            self._failed = True
            raise

    def submit(self, fn, *args, **kwargs) -> None:
        while self._pending and (self._pending[0].done() or len(self._pending) >= self._depth):
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._write, fn, args, kwargs))

    def __exit__(self, exc_type, exc, tb):
        try:  # a caller's own error (not a write's) still lets finished items be written: they are kept
            while self._pending:
                future = self._pending.popleft()
                if exc_type is None:
                    future.result()
                else:  # the caller's error wins; ours only wait to finish
                    future.exception()
        finally:
            self._pool.shutdown(wait=True)
        return False


def load_once(memo: dict | None, key: tuple, load):
    """load(), or the model a worker process loaded earlier for the same key (runner=dask: once per worker,
    not once per shard). Without a memo (one run in the flow's process) it is loaded for this call only."""
    if memo is None:
        return load()
    if key not in memo:
        memo[key] = load()
    return memo[key]


class Memo(OrderedDict):
    """Stored tensors kept in RAM up to `size` entries, the least recently used dropped first."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or_load(self, key, load):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = load()
        if len(self) > self.size:
            self.popitem(last=False)
        return value
