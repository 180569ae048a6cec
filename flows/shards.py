"""The caching nodes' missing items, split into shards that workers compute independently (runner=dask).

Pure core: which item keys a node still lacks and how they are cut; flows/runner.py submits each shard as a
Prefect task to a Dask cluster. A shard is a list of item keys; its worker writes each item to the shared
store like the node would (temp name, fsync, rename), so a worker lost in the middle of a shard leaves its
finished items, and the shard run again computes only the rest."""
from __future__ import annotations

from tasks import cache_latents, cache_text
from tasks.config import Config
from tasks.plan import Plan
from tasks.store import Store


NODES = {"cache_latents": cache_latents, "cache_text": cache_text}
_MODELS: dict = {}  # this worker process's VAE / text encoders, loaded by its first shard


def missing_keys(node: str, cfg: Config, plan: Plan, store: Store) -> list[str]:
    """The node's distinct item keys that the store does not hold (valid), in plan order."""
    module = NODES[node]
    return [k for k in dict.fromkeys(module.item_keys(cfg, plan).values()) if not store.valid(module.KIND, k)]


def split(keys: list[str], n_workers: int, shard_size: int | None = None) -> list[list[str]]:
    """Consecutive shards: `shard_size` keys each, or (None) about 4 shards a worker, so a slow or lost
    worker holds up a small part of the node."""
    if not keys:
        return []
    size = shard_size or max(1, -(-len(keys) // (4 * max(1, n_workers))))
    return [keys[i:i + size] for i in range(0, len(keys), size)]


def compute_shard(node: str, cfg: Config, plan: Plan, store: Store, keys: list[str]) -> int:
    """Computes the shard's items that are still missing (a retried shard skips what it finished); returns
    how many it computed."""
    return NODES[node].run(cfg, plan, store, only=set(keys), models=_MODELS)["computed"]
