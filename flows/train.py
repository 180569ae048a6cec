"""loraflow's training flow.

    validate ─┬─> cache_latents ─┐
              └─> cache_text ────┴─> train ──> sample ──> report.json

CLI:        python -m flows.train [hydra overrides]      (-m for sweeps)
Deployment: train_flow(config_name="train", overrides=[...]) composes with Hydra's compose API.
"""
from __future__ import annotations

import logging
import sys
import time

from prefect import flow

from flows import auth, console, sweep
from flows.artifacts import publish_artifacts
from flows.logs import log_nodes, log_to_file, run_logs
from flows.runner import fill_on_dask
from flows.nodes import (PLANS, RESULTS, cache_latents_task, cache_text_task, keep, load, sample_task, train_task,
                         validate_task)
from tasks import cache_latents, cache_text, sample, train, validate
from tasks.training import interrupt
from tasks.training.checkpoint_samples import all_valid
from tasks.config import ConfigError, compose, resolve_paths
from tasks.data.dataset import DatasetError
from tasks.store.hashing import key_of
from tasks.publish import publish
from tasks.report import NODES, node_entry, write_report
from tasks.store.remote_store import open_store
from tasks.store import CorruptArtifact, Store, StoreFull, track_repairs

log = logging.getLogger("loraflow")
USER_ERRORS = (ConfigError, DatasetError, FileNotFoundError, StoreFull)
_KINDS = {"cache_latents": cache_latents.KIND, "cache_text": cache_text.KIND, "train": train.KIND,
          "sample": sample.KIND}


def _result(store: Store, state) -> dict | None:
    """The node's result the store holds under the key Prefect returned (a copy, with that key as "ref"), or
    None."""
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
def train_flow(config_name: str = "train", overrides: list[str] | None = None) -> dict:
    interrupt.reset()  # a stop asked of an earlier flow run in this process is not this run's
    cfg_node, run_dir = compose(config_name, overrides)
    cfg = resolve_paths(cfg_node)
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log_to_file(run_dir)
    repaired = track_repairs()  # every corrupt entry/record found (and recomputed) in this run, for the report
    store = open_store(cfg["store"])
    previous = (store.read_record(config_name) or {}).get("inputs", {})

    start = time.perf_counter()
    plan = validate_task(cfg)
    checked = {"key": "", "computed": validate.images(plan), "reused": 0, "inputs": validate.inputs(plan),
               "seconds": time.perf_counter() - start}
    checked["key"] = key_of(checked["inputs"])

    # runner=dask: the missing items are computed on the cluster first; the nodes then find them stored
    # The tasks get the plan's key: Prefect never walks 100,000 items. The memory estimate (free RAM now) is
    # for the report only: left out, the same dataset and config give the same plan entry run after run.
    plan_key = keep(store, PLANS, {k: v for k, v in plan.items() if k != "memory"})
    workers = fill_on_dask(cfg, plan, plan_key, store) if cfg["runner"]["name"] == "dask" else None
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

    results = dict(zip(NODES, (checked, latents, texts, lora, samples)))
    artifacts = publish(cfg, plan, store, run_dir, lora, samples["samples"])
    report = {"nodes": {n: node_entry(r, previous.get(n)) for n, r in results.items()},
              "artifacts": {**artifacts, "base_model": plan["model_dir"],
                            # the steps trained in this run (none when the train node was cached)
                            **({"tensorboard": str(tb)} if (tb := run_dir / "tensorboard").is_dir() else {})},
              "config_name": config_name, "warnings": plan["warnings"] + lora.get("sample_warnings", []), "loss": lora.get("losses", []),
              # data.validation_split: [{step, loss}] of the held-out items at fixed draws (tasks/training/validation.py)
              "validation_loss": lora.get("validation_loss", []),
              "memory_estimate": plan["memory"], "dataset": plan["dataset"],
              "dataset_subsets": plan["dataset_subsets"],  # folder, images, repeats, is_reg of each
              "text_augmentation": {**plan["augmentation"], "cached_caption_texts": texts.get("caption_texts", 0)}}
    report["repaired"] = repaired  # "<kind>/<key>": store entries, runs/<config>, filedigests/<memo>
    path = write_report(run_dir, report)
    publish_artifacts(report, path)
    inputs = {n: r["inputs"] for n, r in results.items()}
    if inputs != previous:  # a no-op over 100,000 items writes nothing
        store.write_record(config_name, {"inputs": inputs})
    log_nodes(report["nodes"], cfg)
    log.info("LoRA:    %s", artifacts["lora"])
    log.info("samples: %s (grid: %s)", run_dir / "samples", artifacts["grid"])
    log.info("report:  %s", path)
    from prefect.runtime import flow_run

    return {"report": str(path), "run_dir": str(run_dir), "flow_run_id": str(flow_run.id)}


def check_config_only(config_name: str, overrides: list[str]) -> None:
    """The config checks that read no file and load no model; ConfigError naming every bad key."""
    errors = validate.config_errors(resolve_paths(compose(config_name, overrides)[0]))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def _stop_on_bad_config() -> None:
    """A single run's bad override (misspelt key, wrong type, syntax, bad value) stops here, before Hydra
    and Prefect's API start: exit 2 and one message naming the key, no traceback. Anything but a plain
    run of conf/ (-m, --cfg, --help, -cp/-cd) is left to Hydra."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args()
    if args.multirun and "hydra/launcher=prefect" in args.overrides:  # no server or deployment: one line
        _stop_unless_launcher_ready(args.overrides)
    if any((args.multirun, args.cfg, args.help, args.hydra_help, args.info, args.shell_completion, args.config_path,
            args.config_dir, args.experimental_rerun, args.package, args.resolve)):
        return
    try:
        check_config_only(args.config_name or "train", args.overrides)
    except ConfigError as e:
        print(f"loraflow: stopped before training: {e}", file=sys.stderr)
        sys.exit(2)


def _stop_unless_launcher_ready(overrides: list[str]) -> None:
    from hydra_plugins.loraflow_prefect_launcher.prefect_launcher import why_not_ready

    named = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.launcher.deployment=")]
    if problem := why_not_ready(named[-1] if named else "loraflow/train"):
        print(f"loraflow: sweep not started: {problem}", file=sys.stderr)
        sys.exit(2)


def _hydra_main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    _stop_on_bad_config()
    auth.stop_on_auth_failure()  # a server that wants PREFECT_API_AUTH_STRING: one line, before any work
    console.install_signal_handlers()
    console.shield_temporary_server()

    @hydra.main(config_path="../conf", config_name="train", version_base="1.3")
    def main(cfg) -> float | dict | None:
        for noisy in ("httpx", "httpcore"):  # Hydra's job logging turns on INFO for every library
            logging.getLogger(noisy).setLevel(logging.WARNING)
        hc = HydraConfig.get()
        # Unresolved: iterating the ListConfig would resolve a "train.lr=${...}" override's text here.
        overrides = [*OmegaConf.to_container(hc.overrides.task), f"hydra.run.dir={hc.runtime.output_dir}"]
        console.quiet_user_errors(USER_ERRORS)
        try:
            if hc.mode == RunMode.MULTIRUN:  # a sweep member's bad config: no flow run (a single run's was checked)
                check_config_only(hc.job.config_name, overrides)
            out = train_flow(config_name=hc.job.config_name, overrides=overrides)
        except interrupt.Interrupted as e:  # Ctrl-C / SIGTERM: one line, exit 130 / 143
            console.exit_interrupted(e)
        except USER_ERRORS as e:  # bad data or config: the message names the file/key and the fix
            if hc.mode == RunMode.MULTIRUN:  # the sweep goes on; its summary lists the member as failed
                return sweep.member_failed(hc.runtime.output_dir, e)
            console.exit_user_error(e, "stopped" if isinstance(e, StoreFull) else "stopped before training")
        except Exception as e:
            auth.stop_on_auth_failure(e)
            if hc.mode == RunMode.MULTIRUN:
                return sweep.member_failed(hc.runtime.output_dir, e)
            raise
        print(f"\nloraflow: done. LoRA, samples (grid.png) and report.json are in {out['run_dir']}")
        return sweep.objective(out["report"])  # what hydra/sweeper=optuna minimises

    sweep.seed_optuna(sys.argv)  # hydra/sweeper=optuna: a seeded sampler unless the command line seeds it
    main()
    if sweep.failed_members:  # a sweep: exit non-zero, one line (each member's error is in the summary)
        names = ", ".join(m["member"] for m in sweep.failed_members)
        print(f"loraflow: sweep: {len(sweep.failed_members)} member(s) failed ({names}); errors in "
              f"{sweep.summary_path}", file=sys.stderr)
        sys.exit(1)


cli = _hydra_main  # the `loraflow` console command

if __name__ == "__main__":
    sys.exit(_hydra_main())
