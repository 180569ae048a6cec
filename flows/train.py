"""loraflow's training flow: the DAG, node after node.

    caption ──> validate ─┬─> cache_latents ─┐
                          └─> cache_text ────┴─> train ──> sample ──> publish ──> [learning] ──> report.json

CLI:        python -m flows.train [hydra overrides]      (-m for sweeps; the Hydra app is flows/cli.py)
Deployment: train_flow(config_name="train", overrides=[...]) composes with Hydra's compose API.
"""
from __future__ import annotations

import gc
import logging
import time

if __name__ == "__main__":  # the CLI: no collections during start-up's imports (frozen below)
    gc.disable()

from prefect import flow

from flows import engine_tweaks
from flows.artifacts import publish_artifacts
from flows.logs import log_nodes, log_to_file, run_logs
from flows.runner import fill_on_dask
from flows.run_names import name_this_run, run_name, run_tags
from flows.nodes import (PLANS, RESULTS, caption_task, cache_latents_task, cache_text_task, keep, learning_task, load,
                         sample_task, train_task, validate_task)
from tasks import cache_latents, cache_text, sample, train, validate
from tasks.training import interrupt
from tasks.training.checkpoint_samples import all_valid
from tasks.config import compose, resolve_paths
from tasks.store.hashing import key_of
from tasks.publish import publish
from tasks.report import NODES, assemble, write_report
from tasks.store.remote_store import open_store
from tasks.store import CorruptArtifact, Store, track_repairs

log = logging.getLogger("loraflow")
_KINDS = {"cache_latents": cache_latents.KIND, "cache_text": cache_text.KIND, "train": train.KIND,
          "sample": sample.KIND}


def _result(store: Store, state) -> dict | None:
    """The node's result the store holds under the key Prefect returned (a copy, with that key as "ref"), or
    None. A failed node raises its own error here (not a KeyError of the result it did not leave)."""
    if state.is_failed() or state.is_crashed():
        state.result()
    try:
        returned = dict(state.result())
        ref = returned.pop("result")
        return {**load(store, RESULTS, ref), **returned, "ref": ref}
    except (CorruptArtifact, KeyError, TypeError):  # TypeError: a result persisted before results were stored
        return None


def _run(task, store: Store, **params) -> dict:
    """Run a node; if Prefect answers from its cache, check our store still holds every item it names
    (Prefect cannot know), and recompute otherwise. Adds the node's wall time."""
    start = time.perf_counter()
    state = task(**params, return_state=True)
    result = _result(store, state)
    if state.name == "Cached":
        kind = _KINDS[task.name]
        keys = set(result["items"].values()) if result else set()
        if result and store.all_intact(kind, keys) and \
                all_valid(store, result.get("checkpoint_samples", {})):
            result = {**result, "computed": 0, "reused": len(keys), "repaired": []}
        else:
            log.warning("%s: Prefect's cached result names artifacts the store lacks; recomputing", task.name)
            result = _result(store, task.with_options(refresh_cache=True)(**params, return_state=True))
    store.save_indexes()  # what this node verified or wrote: the next run's no-op answers from stat calls
    result["seconds"] = time.perf_counter() - start
    return result


@flow(name="loraflow", persist_result=False)
@run_logs  # loraflow's log to Prefect's API and <run dir>/loraflow.log
def train_flow(config_name: str = "train", overrides: list[str] | None = None, sweep: str | None = None) -> dict:
    """`sweep`: the sweep this run is a member of (its tag), from `-m`."""
    interrupt.reset()  # a stop asked of an earlier flow run in this process is not this run's
    cfg_node, run_dir = compose(config_name, overrides)
    cfg = resolve_paths(cfg_node)
    name_this_run(run_name(cfg, list(overrides or [])), run_tags(cfg, list(overrides or []), sweep))
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log_to_file(run_dir)
    repaired = track_repairs()  # every corrupt entry/record found (and recomputed) in this run, for the report
    store = open_store(cfg.store)
    previous = (store.read_record(config_name) or {}).get("inputs", {})

    start = time.perf_counter()
    captioned = caption_task(cfg, str(run_dir))  # data.captions=auto|regenerate: the images without a caption
    captioned["seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = validate_task(cfg, captioned["result"] if cfg.data.captions != "file" else None)
    checked = {"key": "", "computed": validate.images(plan), "reused": 0, "inputs": validate.inputs(plan),
               "seconds": time.perf_counter() - start}
    checked["key"] = key_of(checked["inputs"])

    # runner=dask: the missing items are computed on the cluster first; the nodes then find them stored
    # The tasks get the plan's key: Prefect never walks 100,000 items. The memory estimate (free RAM now) is
    # for the report only: left out, the same dataset and config give the same plan entry run after run.
    plan_key = keep(store, PLANS, plan.stored())
    workers = fill_on_dask(cfg, plan, plan_key, store) if cfg.runner.name == "dask" else None
    latents = _run(cache_latents_task, store, key=cache_latents.key_of_node(cfg, plan), cfg=cfg, plan=plan_key)
    texts = _run(cache_text_task, store, key=cache_text.key_of_node(cfg, plan), cfg=cfg, plan=plan_key)
    for node, result in (("cache_latents", latents), ("cache_text", texts)):  # report: who computed what
        on_dask = workers[node] if workers else {"workers": {"local": result["computed"]}, "seconds": 0.0,
                                                 "computed": result["computed"]}
        computed = on_dask["computed"]
        result.update(computed=computed, reused=result["computed"] + result["reused"] - computed,
                      workers={w: n for w, n in on_dask["workers"].items() if n},
                      seconds=result["seconds"] + on_dask["seconds"])
    lora = _run(train_task, store, key=train.key_of_node(cfg, plan, latents["items"], texts["items"]), cfg=cfg,
                plan=plan_key, latents=latents["ref"], texts=texts["ref"], run_dir=str(run_dir))
    samples = _run(sample_task, store, key=sample.key_of_node(cfg, plan, lora["key"], texts["items"]), cfg=cfg,
                   plan=plan_key, lora=lora["ref"], texts=texts["ref"])

    results = dict(zip(NODES, (captioned, checked, latents, texts, lora, samples)))
    artifacts = publish(cfg, plan, store, run_dir, lora, samples["samples"])
    report = assemble(config_name, results, previous, plan, lora, texts, artifacts, run_dir, repaired)
    if cfg.learning.scorer:  # the demo: base vs LoRA, scored (samples/before_after.png)
        report["learning"] = learning_task(cfg, plan.model_dir, artifacts["lora_files"].get("diffusers")
                                           or artifacts["lora"], str(run_dir))
        report["artifacts"]["before_after"] = report["learning"].pop("before_after")
    path = write_report(run_dir, report)
    publish_artifacts(report, path, cfg.export.files_url)
    inputs = {n: r["inputs"] for n, r in results.items()}
    if inputs != previous:  # a no-op over 100,000 items writes nothing
        store.write_record(config_name, {"inputs": inputs})
    log_nodes(report["nodes"], cfg)
    log.info("LoRA:    %s", artifacts["lora"])
    log.info("samples: %s (grid: %s)", run_dir / "samples", artifacts["grid"])
    log.info("report:  %s", path)
    from prefect.runtime import flow_run

    return {"report": str(path), "run_dir": str(run_dir), "flow_run_id": str(flow_run.id)}


engine_tweaks.send_plain_parameters(train_flow)  # a config name and override strings, sent as they are


if __name__ == "__main__":  # python -m flows.train: the Hydra CLI (flows/cli.py), started as `loraflow` is
    from flows.cli import main
    from flows.entry import run_and_exit

    # The ~140,000 objects of the imports (modules, classes, pydantic schemas) live until exit: frozen, no
    # later collection walks them, nor the one at exit (a no-op run: 0.4 s less on 2 cores, 2.7 -> 2.3 s)
    gc.freeze()
    gc.enable()
    run_and_exit(main)
