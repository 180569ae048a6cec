"""Figures 4-5: the whole flow (`flows.train.train_flow`, Prefect's ephemeral API in this process) over
1,000 generated images with captions: a no-op re-run, and a re-run after editing one caption.

Prefect's own start-up is measured in the same process with an empty flow run: once cold (the first
flow run, which starts the temporary API server) and then warm, alternated with the no-op re-runs.
Figure 4 is median(no-op train_flow) - median(warm empty flow).

Prefect 3.8's flow engine joins a heartbeat thread that sleeps in 1 s steps when a flow run ends
(flows.heartbeat_frequency defaults to 180 s), so flow-run wall times are quantized to about one second:
an empty flow and a flow doing 0.9 s of work both take ~1.07 s. The flow body's own time (compose,
validate, the four cache checks, publish, report) is therefore also measured directly, by wrapping
`train_flow.fn` for the duration of the benchmark."""
from __future__ import annotations

import cProfile
import functools
import io
import json
import pstats
import time
from pathlib import Path

from bench.common import make_dataset, median, write_prompts

NOOP_GOAL_S = 5.0


def _empty_flows():
    from prefect import flow, task

    @flow(name="bench-empty", persist_result=False)
    def empty() -> None:
        return None

    @task(name="bench-noop", persist_result=False)
    def noop(i: int) -> int:
        return i

    @flow(name="bench-five-tasks", persist_result=False)
    def five_tasks() -> None:  # context only: what five trivial Prefect tasks cost (our DAG has five nodes)
        for i in range(5):
            noop(i)

    return empty, five_tasks


def _timed(fn, *args, **kwargs) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t, out


def bench_rerun(work: Path, n_images: int, size: int, reruns: int, profile_to: Path | None,
                force_profile: bool = False) -> dict:
    import flows.train as flow_module
    from flows.train import train_flow

    data, prompts, store = work / "data", work / "prompts.txt", work / "store"
    t = time.perf_counter()
    paths = make_dataset(data, n_images, size, seed=1)
    write_prompts(prompts, 2, negative_every=0)
    gen_s = time.perf_counter() - t
    counter = iter(range(1, 10**6))

    def overrides() -> list[str]:
        return [f"data.dir={data}", f"sample.prompts_file={prompts}", f"store.root={store}",
                f"data.resolution={size}", f"hydra.run.dir={work / 'runs' / f'run{next(counter)}'}",
                "train.max_steps=4", "train.log_every=2", "sample.steps=2"]

    body_s: list[float] = []
    original_fn = train_flow.fn

    @functools.wraps(original_fn)
    def timed_body(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original_fn(*args, **kwargs)
        finally:
            body_s.append(time.perf_counter() - t0)

    def flow_run() -> tuple[float, dict]:
        dt, out = _timed(train_flow, config_name="train", overrides=overrides())
        return dt, json.loads(Path(out["report"]).read_text())

    assert flow_module.train_flow is train_flow
    train_flow.fn = timed_body
    try:
        return _measure(flow_run, body_s, paths, n_images, size, reruns, profile_to, gen_s, force_profile)
    finally:
        train_flow.fn = original_fn


def _measure(flow_run, body_s, paths, n_images, size, reruns, profile_to, gen_s, force_profile) -> dict:
    empty, five_tasks = _empty_flows()
    cold_s, _ = _timed(empty)  # first flow run in this process: starts Prefect's temporary API server
    first_s, first = flow_run()  # computes everything (1,000 latents, 1,000+ texts, a LoRA, samples)

    noop_s, noop_body_s, empty_s, five_s, noop_reports = [], [], [], [], []
    for r in range(reruns):  # alternate the no-op re-run with the empty flow runs
        for what in (("noop", "empty", "five") if r % 2 == 0 else ("five", "empty", "noop")):
            if what == "noop":
                dt, report = flow_run()
                noop_s.append(dt)
                noop_body_s.append(body_s[-1])
                noop_reports.append(report)
            elif what == "empty":
                empty_s.append(_timed(empty)[0])
            else:
                five_s.append(_timed(five_tasks)[0])
    last = noop_reports[len(noop_reports) // 2]
    all_cached = all(n["computed"] == 0 for name, n in last["nodes"].items() if name != "validate")
    beyond = median(noop_s) - median(empty_s)

    profile = None
    if profile_to is not None and (beyond > NOOP_GOAL_S or force_profile):
        profile = _profile(flow_run, profile_to)

    # Figure 5: edit one caption of 1,000, re-run.
    victim = paths[n_images // 2].with_suffix(".txt")
    victim.write_text(victim.read_text().strip() + ", edited\n")
    edit_s, edited = flow_run()
    nodes = edited["nodes"]
    return {
        "images": n_images, "size": size, "dataset_generation_s": gen_s,
        "prefect_cold_start_s": cold_s, "prefect_empty_flow_s": empty_s, "prefect_empty_flow_median_s": median(empty_s),
        "prefect_five_trivial_tasks_flow_s": five_s, "prefect_five_trivial_tasks_median_s": median(five_s),
        "first_run_s": first_s, "first_run_nodes": _nodes(first),
        "noop_rerun_s": noop_s, "noop_rerun_median_s": median(noop_s), "noop_beyond_prefect_s": beyond,
        "noop_flow_body_s": noop_body_s, "noop_flow_body_median_s": median(noop_body_s),
        "first_run_body_s": body_s[0],
        "noop_all_cached": all_cached, "noop_rerun_nodes": _nodes(last), "noop_profile": profile,
        "edit_caption": victim.name, "edit_rerun_s": edit_s, "edit_rerun_nodes": _nodes(edited),
        "edit_text_computed": nodes["cache_text"]["computed"],
        "edit_changed": nodes["cache_text"]["changed"],
    }


def _nodes(report: dict) -> dict:
    return {n: {k: v for k, v in e.items() if k in ("status", "computed", "reused", "seconds")}
            for n, e in report["nodes"].items()}


def _profile(flow_run, out: Path) -> dict:
    """One more no-op re-run under cProfile; the top of the profile is written to `out`."""
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    flow_run()
    prof.disable()
    dt = time.perf_counter() - t
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    buf.write(f"no-op re-run under cProfile: {dt:.2f} s wall\n\n== by cumulative time ==\n")
    stats.print_stats(60)
    buf.write("\n== by own time ==\n")
    stats.sort_stats("tottime").print_stats(40)
    out.write_text(buf.getvalue())
    return {"file": str(out), "wall_s_under_profiler": dt}
