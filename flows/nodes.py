"""The five Prefect tasks: thin shells over the plain functions in tasks/.

Prefect's cache key for a node is loraflow's own node key (content digests + code versions), never
Prefect's hash of pickled inputs. Results are small JSON dicts (keys, counts, paths): tensors stay in
the store and Prefect never pickles them."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.artifacts import sample_point_artifact
from tasks import cache_latents, cache_text, sample, train, validate
from tasks.hashing import key_of
from tasks.remote_store import open_store


def _node_key(context, parameters) -> str:
    # The store (root and local working copy) is part of it: a cached result names files in that store.
    return f"{context.task.name}-{parameters['key']}-{key_of(parameters['cfg']['store'])[:16]}"


_cached = dict(cache_key_fn=_node_key, persist_result=True, result_serializer="json")


@task(name="validate", cache_policy=NO_CACHE, persist_result=False)
def validate_task(cfg: dict) -> dict:
    # Never cached by Prefect: this is the node that looks at the files to find what changed.
    return validate.run(cfg, open_store(cfg["store"]))


@task(name="cache_latents", **_cached)
def cache_latents_task(key: str, cfg: dict, plan: dict) -> dict:
    return cache_latents.run(cfg, plan, open_store(cfg["store"]))


@task(name="cache_text", **_cached)
def cache_text_task(key: str, cfg: dict, plan: dict) -> dict:
    return cache_text.run(cfg, plan, open_store(cfg["store"]))


@task(name="train", **_cached)
def train_task(key: str, cfg: dict, plan: dict, latent_keys: dict, text_keys: dict, run_dir: str | None = None) -> dict:
    # run_dir (where TensorBoard logs and live samples go) is not part of the key: it changes no artifact.
    return train.run(cfg, plan, open_store(cfg["store"]), latent_keys, text_keys, run_dir and Path(run_dir),
                     on_samples=[sample_point_artifact])


@task(name="sample", **_cached)
def sample_task(key: str, cfg: dict, plan: dict, lora_key: str, lora_file: str, text_keys: dict) -> dict:
    return sample.run(cfg, plan, open_store(cfg["store"]), lora_key, lora_file, text_keys)
