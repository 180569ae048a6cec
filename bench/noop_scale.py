"""Figures 6-7 (issue 20, item 3): a no-op re-run over 100,000 images, through the CLI as a user runs it, against
a Prefect server that is already running (`prefect server start` on 127.0.0.1, started by the benchmark).

    .venv/bin/python -m bench.noop_scale                  # 100,000 images: ~30 min for the first (caching) run
    .venv/bin/python -m bench.noop_scale --images 5000    # quicker

Figure 6, start-up: wall time of `python -m flows.train` for a no-op over the 12-image demo (imports, Hydra,
the flow run on the server, five nodes answering "cached"). Goal <= 1.5 s (issue 46; < 5 s in issue 20).
Figure 7, a no-op over N images beyond start-up: wall time of the same command over N images minus figure 6.
Goal <= 10 s at 100,000. Beside it, the bare floor: a walk of data.dir with one stat call per file (what
`dvc status` is bound by) and the node seconds from report.json, so the ratio ours / bare says what the
bookkeeping costs beyond touching each file once.

Both no-op runs are repeated (alternated, median). The images are 16 px random-noise PNGs with distinct
captions (every latent and text is its own store entry); everything lives in a temporary folder, removed at
the end unless --keep. Writes bench/noop_scale.json."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine_info, median, versions

REPO = Path(__file__).resolve().parents[1]
STARTUP_GOAL_S, NOOP_GOAL_S = 1.5, 10.0


def make_images(folder: Path, n: int, size: int) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f"img_{i:06d}.png")
        (folder / f"img_{i:06d}.txt").write_text(f"random picture number {i}")


def bare_stat_walk(folder: Path) -> float:
    """One stat call per file under folder (os.scandir): the floor of any no-op that looks at every file."""
    t = time.perf_counter()
    with os.scandir(folder) as it:
        for e in it:
            e.stat()
    return time.perf_counter() - t


def cli_run(env: dict, work: Path, data: Path, name: str, size: int,
            python: tuple[str, ...] = ()) -> tuple[float, dict]:
    # Each dataset its own store: the store's run record (the last run's inputs, for the report's "changed")
    # is per config name, and two datasets alternating under one name would rewrite 100,000 items' record
    # on every run, which neither no-op does alone. `python`: options before -m (cProfile's).
    cmd = [sys.executable, *python, "-m", "flows.train", f"data.dir={data}", f"store.root={work / 'store'}-{data.name}",
           f"sample.prompts_file={work / 'prompts.txt'}", f"data.resolution={size}", f"sample.width={size}",
           f"sample.height={size}", "train.max_steps=2", "sample.steps=1", f"hydra.run.dir={work / 'runs' / name}"]
    t = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return wall, json.loads((work / "runs" / name / "report.json").read_text())


def write_profile(prof: Path, out: Path, top: int = 40) -> None:
    """The CLI no-op's profile by cumulative time (cProfile slows it about 1.5x: shares, not seconds)."""
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(str(prof), stream=text).sort_stats("cumulative").print_stats(top)
    out.write_text(f"CLI no-op over the 12-image demo under cProfile ({time.strftime('%Y-%m-%d')})\n{text.getvalue()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "noop_scale.json"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="then one more demo no-op under cProfile: its top entries in bench/profile_startup.txt")
    ap.add_argument("--work", help="a folder to keep everything in, and to reuse on the next call (its images "
                                   "and store: the first run is then a no-op too)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from prefect_server import prefect_server

    start = time.perf_counter()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="loraflow-noop-"))
    reuse = (work / "big").is_dir()
    work.mkdir(parents=True, exist_ok=True)
    try:
        (work / "prompts.txt").write_text("a random picture\n")
        big, demo = work / "big", work / "demo"
        t = time.perf_counter()
        if not reuse:
            make_images(big, args.images, args.size)
            shutil.copytree(REPO / "data" / "demo", demo)
        gen_s = time.perf_counter() - t
        args.images = sum(1 for f in os.scandir(big) if f.name.endswith(".png"))
        shutil.rmtree(work / "prefect", ignore_errors=True)
        with prefect_server(work / "prefect") as server:
            env = server.env  # PREFECT_API_URL of the running server, a PREFECT_HOME of its own
            first_big, report = cli_run(env, work, big, "first-big", args.size)
            first_demo, _ = cli_run(env, work, demo, "first-demo", args.size)
            for name, path in (("big", big), ("demo", demo)):  # settle: files of the first run now outside the racy window
                time.sleep(2.1)
                cli_run(env, work, path, f"settle-{name}", args.size)
            walls = {"big": [], "demo": []}
            reports = {}
            for r in range(args.reps):
                for which in (("big", "demo") if r % 2 == 0 else ("demo", "big")):
                    wall, reports[which] = cli_run(env, work, big if which == "big" else demo, f"{which}{r}", args.size)
                    walls[which].append(wall)
            if args.profile:
                cli_run(env, work, demo, "profile", args.size, ("-m", "cProfile", "-o", str(work / "startup.prof")))
                write_profile(work / "startup.prof", REPO / "bench" / "profile_startup.txt")
        stat_s = median([bare_stat_walk(big) for _ in range(3)])
        startup = median(walls["demo"])
        beyond = median(walls["big"]) - startup
        nodes = reports["big"]["nodes"]
        cached = all(nodes[n]["status"] == "cached" and nodes[n]["computed"] == 0 for n in nodes if n != "validate")
        result = {
            "figures": [
                {"name": "6: CLI no-op start-up with a running Prefect server (12-image demo)", "value": round(startup, 2),
                 "unit": "s", "goal": f"<= {STARTUP_GOAL_S}", "meets": startup <= STARTUP_GOAL_S},
                {"name": f"7: CLI no-op over {args.images} images, beyond start-up", "value": round(beyond, 2),
                 "unit": "s", "goal": f"<= {NOOP_GOAL_S} at 100000", "meets": beyond <= NOOP_GOAL_S and cached},
            ],
            "bare": {"stat_walk_s": round(stat_s, 3), "ours_beyond_startup_vs_stat_walk": round(beyond / stat_s, 1)},
            "details": {"images": args.images, "size": args.size, "generate_s": round(gen_s, 1),
                        "first_run_big_s": round(first_big, 1), "reused_work": reuse, "first_run_demo_s": round(first_demo, 1),
                        "noop_big_walls_s": [round(w, 2) for w in walls["big"]],
                        "noop_demo_walls_s": [round(w, 2) for w in walls["demo"]], "noop_all_cached": cached,
                        "noop_big_node_seconds": {n: e["seconds"] for n, e in nodes.items()},
                        "first_run_computed": {n: e["computed"] for n, e in report["nodes"].items()}},
            "machine": machine_info(), "versions": versions(), "date": time.strftime("%Y-%m-%d"),
            "total_seconds": round(time.perf_counter() - start, 1),
        }
    finally:
        if not (args.keep or args.work):
            shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for f in result["figures"]:
        print(f"{f['name']}: {f['value']} {f['unit']} (goal {f['goal']}: {'meets' if f['meets'] else 'misses'})")
    print(f"bare stat walk of data.dir: {stat_s:.2f} s; ours beyond start-up / bare = {beyond / stat_s:.1f}x")
    print(f"node seconds of the no-op: {result['details']['noop_big_node_seconds']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
