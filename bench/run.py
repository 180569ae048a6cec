"""loraflow CPU benchmark: `python -m bench.run` (from the repository root, with .venv/bin/python).

Measures five figures, each beside a bare loop doing the same work in the same process (alternated,
medians), prints a table and writes bench/results.json:
  1. latent caching throughput, cache_latents.run / bare AutoencoderKL.encode loop     goal >= 0.95
  2. text caching throughput, cache_text.run / bare CLIP+T5 loop                        goal >= 0.95
  3. train step time, train node / bare diffusers+peft loop (steady state)              goal <= 1.05
  4. no-op re-run of the whole flow over 1,000 images, seconds beyond Prefect's start-up goal <= 5 s
  5. edit 1 of 1,000 captions: text items computed                                      goal == 1
Figures 1-3 use a mid-sized Flux (bench/common.py: MID_ARCH) at 256 px; 4-5 the default tiny_flux at 32 px.
Options: --quick (smaller, for development), --out PATH, --keep (keep the temp folder), --only 1,2,...
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent


def bench_env(work: Path) -> None:
    """Before anything imports Prefect: a private PREFECT_HOME and its ephemeral API, offline HF."""
    home = work / "prefect"
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(home / "storage")
    os.environ.pop("PREFECT_API_URL", None)  # never a real server: the ephemeral API, in this process
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The temporary server's telemetry heartbeat writes to its SQLite DB in the background and logs
    # "database is locked" tracebacks when it collides with the run's writes: off, as on an offline machine.
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"


def figure(name: str, value: float, unit: str, goal: str, meets: bool) -> dict:
    return {"name": name, "value": float(value), "unit": unit, "goal": goal, "meets": bool(meets)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (development only)")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--profile", action="store_true",
                    help="always write bench/profile_noop.txt (cProfile of one no-op re-run); by default only when "
                         "figure 4 misses its goal")
    ap.add_argument("--only", default="1,2,3,4", help="figure groups to run: 1,2,3 and 4 (= figures 4 and 5)")
    args = ap.parse_args(argv)
    only = {int(x) for x in args.only.split(",") if x}

    clock0 = time.perf_counter()
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="loraflow-bench-"))
    bench_env(work)
    from bench import common, compute, rerun  # noqa: E402  (after bench_env)

    q = args.quick
    sizes = {"mid_images": 8 if q else 16, "mid_prompts": 4, "reps": 2 if q else 9, "train_steps": 6 if q else 10,
             "train_warm_steps": 2, "train_reps": 1 if q else 9, "rerun_images": 200 if q else 1000,
             "rerun_size": 32, "reruns": 2 if q else 3}
    figures, details, errors = [], {}, {}
    print(f"loraflow bench: work folder {work}", flush=True)
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        print(f"WARNING: load average {load_start[0]:.1f} on {os.cpu_count()} CPUs: other work is running and CPU "
              "timings will be slow and noisy (ours and bare are alternated, but contention varies)", flush=True)

    try:
        if only & {1, 2, 3}:
            data, prompts = work / "mid_data", work / "mid_prompts.txt"
            common.make_dataset(data, sizes["mid_images"], common.MID_RES, seed=0)
            common.write_prompts(prompts, sizes["mid_prompts"])
            train_cfg = {"max_steps": sizes["train_steps"], "log_every": 1, "rank": 16, "batch_size": 2,
                         "lr": 1e-4, "seed": 0}
            cfg = compute.mid_cfg(data, prompts, work / "mid_store", train_cfg)
            t = time.perf_counter()
            plan, store = compute.plan_for(cfg)  # builds the mid-sized model into the store once
            details["mid_model"] = {"arch": common.MID_ARCH, "max_sequence_length": common.MID_SEQ,
                                    "resolution": common.MID_RES, "build_and_validate_s": time.perf_counter() - t,
                                    **_param_counts(plan.model_dir)}
            lat = txt = None
            if 1 in only or 3 in only:
                print("figure 1: latent caching ...", flush=True)
                lat = _guard(errors, "1", compute.bench_latents, cfg, plan, store, work, sizes["reps"])
            if lat:
                details["latents"] = {k: v for k, v in lat.items() if k != "latent_keys"}
                if 1 in only:
                    figures.append(figure("latent caching throughput: cache_latents.run / bare AutoencoderKL.encode loop",
                                          lat["ratio"], "x", ">= 0.95", lat["ratio"] >= 0.95))
            if 2 in only or 3 in only:
                print("figure 2: text caching ...", flush=True)
                txt = _guard(errors, "2", compute.bench_text, cfg, plan, store, work, sizes["reps"])
            if txt:
                details["text"] = {k: v for k, v in txt.items() if k != "text_keys"}
                if 2 in only:
                    figures.append(figure("text caching throughput: cache_text.run / bare CLIP+T5 encoder loop",
                                          txt["ratio"], "x", ">= 0.95", txt["ratio"] >= 0.95))
            if 3 in only and lat and txt:
                print("figure 3: train step ...", flush=True)
                tr = _guard(errors, "3", compute.bench_train, cfg, plan, store, lat["latent_keys"], txt["text_keys"],
                            sizes["train_reps"], sizes["train_warm_steps"])
                if tr:
                    details["train"] = tr
                    figures.append(figure("train step time (steady state): train node / bare diffusers+peft loop",
                                          tr["ratio"], "x", "<= 1.05", tr["ratio"] <= 1.05))
        if 4 in only:
            print(f"figures 4-5: whole flow over {sizes['rerun_images']} images ...", flush=True)
            rr = _guard(errors, "4", rerun.bench_rerun, work / "rerun", sizes["rerun_images"], sizes["rerun_size"],
                        sizes["reruns"], HERE / "profile_noop.txt", args.profile)
            if rr:
                details["rerun"] = rr
                n = sizes["rerun_images"]
                figures.append(figure(f"no-op re-run over {n} images: train_flow wall time beyond Prefect's start-up "
                                      "(empty flow run)", rr["noop_beyond_prefect_s"], "s", "<= 5",
                                      rr["noop_beyond_prefect_s"] <= rerun.NOOP_GOAL_S and rr["noop_all_cached"]))
                figures.append(figure(f"edit 1 of {n} captions: cache_text items computed", rr["edit_text_computed"],
                                      "items", "== 1", rr["edit_text_computed"] == 1))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    total = time.perf_counter() - clock0
    machine = common.machine_info()
    machine["loadavg_at_start"] = load_start
    machine["loadavg_at_end"] = os.getloadavg()
    results = {"figures": figures, "machine": machine, "versions": common.versions(),
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "total_seconds": total,
               "config": {**sizes, "quick": q, "mid_arch": common.MID_ARCH, "mid_resolution": common.MID_RES,
                          "mid_max_sequence_length": common.MID_SEQ,
                          "method": "ours and bare alternated in one process; medians; figure 1-2 include loading "
                                    "the model in both; figure 3 excludes loading and the first "
                                    f"{sizes['train_warm_steps'] + 1} steps in both"},
               "details": details, "errors": errors}
    Path(args.out).write_text(json.dumps(results, indent=1))
    _table(figures, details, total)
    print(f"\nwrote {args.out}")
    if errors:
        print("errors: " + "; ".join(f"figure {k}: {v.splitlines()[-1]}" for k, v in errors.items()), file=sys.stderr)
    return 1 if errors else 0


def _guard(errors: dict, name: str, fn, *a):
    try:
        return fn(*a)
    except Exception:
        errors[name] = traceback.format_exc()
        print(f"figure {name} failed:\n{errors[name]}", file=sys.stderr, flush=True)
        return None


def _param_counts(model_dir: str) -> dict:
    from safetensors import safe_open

    out = {}
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        n = 0
        for f in sorted(Path(model_dir, part).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    n += _prod(st.get_slice(k).get_shape())
        out[f"{part}_params"] = n
    return out


def _prod(shape) -> int:
    p = 1
    for s in shape:
        p *= s
    return p


def _table(figures: list, details: dict, total: float) -> None:
    rows = [("#", "figure", "value", "goal", "meets")]
    for i, f in enumerate(figures, 1):
        v = f"{f['value']:.3f} {f['unit']}" if f["unit"] != "items" else f"{f['value']:g} {f['unit']}"
        rows.append((str(i), f["name"], v, f["goal"], "yes" if f["meets"] else "NO"))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    print()
    for j, r in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    d = details
    print()
    if "latents" in d:
        print(f"  latents: ours {d['latents']['ours_median']:.2f} img/s, bare {d['latents']['bare_median']:.2f} img/s "
              f"({d['latents']['images']} images at {d['latents']['size'][0]} px)")
    if "text" in d:
        print(f"  text:    ours {d['text']['ours_median']:.2f} texts/s, bare {d['text']['bare_median']:.2f} texts/s "
              f"({d['text']['texts']} texts)")
    if "train" in d:
        print(f"  train:   ours {d['train']['ours_median'] * 1000:.0f} ms/step, bare {d['train']['bare_median'] * 1000:.0f}"
              f" ms/step (batch {d['train']['batch_size']}, rank {d['train']['rank']})")
    if "rerun" in d:
        r = d["rerun"]
        print(f"  flow:    no-op re-run {r['noop_rerun_median_s']:.2f} s, empty flow {r['prefect_empty_flow_median_s']:.2f} s"
              f" (cold {r['prefect_cold_start_s']:.2f} s), five trivial tasks {r['prefect_five_trivial_tasks_median_s']:.2f}"
              f" s, first run {r['first_run_s']:.1f} s, edit re-run {r['edit_rerun_s']:.1f} s")
        print(f"           no-op flow body (loraflow's own work inside the flow run) {r['noop_flow_body_median_s']:.2f} s;"
              " Prefect's heartbeat join quantizes flow wall times to ~1 s")
        print("           no-op node seconds: " + ", ".join(f"{n} {e['seconds']:.2f}" for n, e in r["noop_rerun_nodes"].items()))
    print(f"  total {total:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
