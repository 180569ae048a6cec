"""`runner=dask`: the caching nodes' missing items as shards, each a Prefect task on a Dask cluster
(prefect-dask's DaskTaskRunner), before the nodes run. The nodes then find every item in the store, and
the report says which worker computed how many (`nodes.<cache node>.workers`).

    runner.address=tcp://host:8786   an existing cluster (dask-cuda's LocalCUDACluster: one worker per GPU)
    runner.n_workers=N               a distributed.LocalCluster of N processes, started and stopped by the run

Shard tasks return small dicts (worker address, count); items travel through the store, never through
Prefect or Dask. A shard whose worker dies is run again by Dask on another worker (and by Prefect's task
retries after an error); what it had finished is in the store and is not computed again."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections import Counter

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows import shards
from tasks.config import Config
from tasks.config_schema import RunnerConfig
from tasks.plan import Plan
from tasks.store.remote_store import open_store


log = logging.getLogger("loraflow")
# Test-only fault: "NODE:N:PATH" makes the first shard of NODE (the one that creates PATH) kill its own
# worker process after storing N items
FAULT_ENV = "LORAFLOW_FAULT_KILL_WORKER_AFTER"


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return "local"


def _not_a_user_error(task, task_run, state) -> bool:
    from flows.errors import USER_ERRORS

    try:
        state.result()
    except USER_ERRORS:
        return False  # bad data or config: the same again on a retry
    except Exception:
        return True
    return False


def _with_fault(store, node: str):
    spec = os.environ.get(FAULT_ENV)
    if not spec or not spec.startswith(node + ":"):
        return store
    after, marker = spec.split(":", 2)[1:]
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # only the first shard to get here
    except FileExistsError:
        return store
    put, written = store.put_tensors, [0]

    def put_then_die(*args, **kwargs):
        put(*args, **kwargs)
        written[0] += 1
        if written[0] >= int(after):
            os.kill(os.getpid(), signal.SIGKILL)  # the worker process dies mid-shard, as on an OOM kill
    store.put_tensors = put_then_die
    return store


@task(name="cache_shard", cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=1,
      retry_condition_fn=_not_a_user_error)
def cache_shard(node: str, cfg: Config, plan: str, keys: list[str]) -> dict:
    """`plan`: its key in the store (every worker reads it there, once)."""
    from flows.nodes import load_plan

    store = _with_fault(open_store(cfg.store), node)
    computed = shards.compute_shard(node, cfg, load_plan(store, plan), store, keys)
    store.save_indexes()
    return {"worker": _worker_address(), "computed": computed}


def task_runner(rc: RunnerConfig):
    from prefect_dask import DaskTaskRunner

    if rc.address:
        return DaskTaskRunner(address=rc.address)
    return DaskTaskRunner(cluster_class="distributed.LocalCluster",
                          cluster_kwargs={"n_workers": int(rc.n_workers), "threads_per_worker": 1,
                                          "processes": True, "dashboard_address": None})


@contextlib.contextmanager
def _api_for_workers(rc: RunnerConfig):
    """The shard tasks report to this run's Prefect API. A LocalCluster's workers inherit the environment
    it is started with, so PREFECT_API_URL names the API this flow uses (the CLI's temporary one included);
    without it each worker would start a temporary API of its own. Workers of an existing cluster
    (runner.address) need PREFECT_API_URL of a server they can reach, set where they were started."""
    from prefect.client.orchestration import get_client

    if rc.address:
        yield
        return
    with get_client(sync_client=True) as client:
        url = str(client.api_url).rstrip("/")
    before = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before


def fill_on_dask(cfg: Config, plan: Plan, plan_key: str, store) -> dict[str, dict]:
    """Computes both caching nodes' missing items on the cluster; per node {"workers": {worker address: items
    computed}, "seconds"}."""
    rc = cfg.runner
    missing = {node: shards.missing_keys(node, cfg, plan, store) for node in shards.NODES}
    todo = {node: shards.split(keys, rc.n_workers, rc.shard_size) for node, keys in missing.items()}
    if not any(todo.values()):
        return {node: {"workers": {}, "seconds": 0.0, "computed": 0} for node in todo}
    where = rc.address or f"a local cluster of {rc.n_workers} worker(s)"
    log.info("runner: %s shard(s) on %s", ", ".join(f"{len(s)} {n}" for n, s in todo.items()), where)
    start = time.perf_counter()
    with _api_for_workers(rc), task_runner(rc) as runner:
        futures = {node: [runner.submit(cache_shard, parameters={"node": node, "cfg": cfg, "plan": plan_key, "keys": shard})
                          for shard in node_shards] for node, node_shards in todo.items()}
        done = {}
        for node, fs in futures.items():
            counts = Counter()
            for f in fs:
                out = f.result()
                counts[out["worker"]] += out["computed"]
            # seconds from the cluster's start until this node's last shard was done (the nodes' shards overlap)
            # computed: every item missing before (a worker lost mid-shard stored some it never reported)
            done[node] = {"workers": dict(counts), "seconds": time.perf_counter() - start,
                          "computed": len(missing[node])}
    log.info("runner: %s", "; ".join(f"{node} {sum(d['workers'].values())} item(s) on {len(d['workers'])} "
                                     f"worker(s), {d['seconds']:.1f} s" for node, d in done.items()))
    return done
