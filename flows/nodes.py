"""The Prefect tasks of the nodes: thin shells over the plain functions in tasks/.

Prefect's cache key for a node is loraflow's own node key (content digests + code versions), never
Prefect's hash of pickled inputs. Prefect holds keys, the store holds everything else: the plan (every
item of the dataset) and each node's result (its item keys and inputs) are JSON files in the store,
and a task's parameters and persisted result name them by key. Prefect walks every parameter and persists
every result; with 100,000 items in them that alone took minutes."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.artifacts import TrainingProgress, sample_point_artifact
from tasks import caption, cache_latents, cache_text, learning, sample, train, validate
from tasks.config import Config, as_plain
from tasks.plan import Plan
from tasks.store.hashing import key_of
from tasks.store.remote_store import open_store


PLANS, RESULTS = "plans", "results"  # <store>/flowstate/<area>/: validate's plan, the other nodes' results
_LOADED: dict[tuple[str, str], dict] = {}  # (kind, key) -> JSON this process stored or read: read once


def keep(store, kind: str, obj: dict) -> str:
    """Stores `obj` as a JSON entry keyed by its content; returns the key."""
    key = store.put_state(kind, obj)
    _LOADED[(kind, key)] = obj
    return key


def load(store, kind: str, key: str) -> dict:
    """A plan or result by key (verified when read from the store; CorruptArtifact when it is not there)."""
    if (kind, key) not in _LOADED:
        if len(_LOADED) > 16:  # a long-lived worker process runs many flows: keep the last few
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[(kind, key)] = store.get_state(kind, key)
    return _LOADED[(kind, key)]


def load_plan(store, key: str) -> Plan:
    """validate's plan by its key in the store."""
    return Plan.from_stored(load(store, PLANS, key))


# What differs between two runs of a node with the same key: Prefect's result carries these, the store the rest
# (so a re-run that repaired an item stores no second copy of an unchanged result)
RUN_FIELDS = ("computed", "reused", "repaired", "continued_from_step")


def _kept(store, result: dict) -> dict:
    store.save_indexes()  # the entries this node verified or wrote: the next no-op answers from stat calls
    lasting = {k: v for k, v in result.items() if k not in RUN_FIELDS}
    return {"result": keep(store, RESULTS, lasting),
            **{k: result[k] for k in RUN_FIELDS if k in result}}


def _node_key(context, parameters) -> str:
    # The store (root and local working copy) is part of it: a cached result names files in that store.
    return f"{context.task.name}-{parameters['key']}-{key_of(as_plain(parameters['cfg'].store))[:16]}"


_cached = dict(cache_key_fn=_node_key, persist_result=True, result_serializer="json")


@task(name="caption", cache_policy=NO_CACHE, persist_result=False)
def caption_task(cfg: Config, run_dir: str | None = None) -> dict:
    # Never cached by Prefect: it looks at the image folder (new images, hand-written captions); its result (a
    # caption per image) is kept in the store, Prefect gets its key.
    store = open_store(cfg.store)
    result = caption.run(cfg, store, run_dir and Path(run_dir))
    return {**{k: v for k, v in result.items() if k != "captions"}, "result": keep(store, RESULTS, result)}


@task(name="validate", cache_policy=NO_CACHE, persist_result=False)
def validate_task(cfg: Config, captions: str | None = None) -> dict:
    # Never cached by Prefect: this is the node that looks at the files to find what changed. `captions`: the
    # caption node's result key (its captions are read instead of those images' caption files).
    store = open_store(cfg.store)
    return validate.run(cfg, store, load(store, RESULTS, captions)["captions"] if captions else None)


# Each takes the plan's key and its upstream nodes' result keys, and returns {"result": key}.
@task(name="cache_latents", **_cached)
def cache_latents_task(key: str, cfg: Config, plan: str) -> dict:
    store = open_store(cfg.store)
    return _kept(store, cache_latents.run(cfg, load_plan(store, plan), store))


@task(name="cache_text", **_cached)
def cache_text_task(key: str, cfg: Config, plan: str) -> dict:
    store = open_store(cfg.store)
    return _kept(store, cache_text.run(cfg, load_plan(store, plan), store))


@task(name="train", **_cached)
def train_task(key: str, cfg: Config, plan: str, latents: str, texts: str, run_dir: str | None = None) -> dict:
    # run_dir (where TensorBoard logs and live samples go) is not part of the key: it changes no artifact.
    store = open_store(cfg.store)
    latent_keys, text_keys = load(store, RESULTS, latents)["items"], load(store, RESULTS, texts)["items"]
    return _kept(store, train.run(cfg, load_plan(store, plan), store, latent_keys, text_keys,
                                run_dir and Path(run_dir), on_samples=[sample_point_artifact],
                                on_step=[TrainingProgress()]))


@task(name="sample", **_cached)
def sample_task(key: str, cfg: Config, plan: str, lora: str, texts: str) -> dict:
    store = open_store(cfg.store)
    trained = load(store, RESULTS, lora)
    return _kept(store, sample.run(cfg, load_plan(store, plan), store, trained["key"], trained["lora"],
                                 load(store, RESULTS, texts)["items"]))


@task(name="learning", cache_policy=NO_CACHE, persist_result=False)
def learning_task(cfg: Config, model_dir: str, lora_file: str, run_dir: str) -> dict:
    # learning.scorer (the demo): base vs LoRA on the generated world's prompts; renders a few dozen tiny images.
    return learning.run(cfg, Path(model_dir), Path(lora_file), Path(run_dir))
