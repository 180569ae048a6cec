"""Video latent caching against a bare diffusers VAE loop (issue 33): `python -m bench.video_cache [--out PATH]`.

Measured: seconds to encode N mp4 clips (made here: a shape moving over a noisy ground, written with
tasks.data.clips.write_mp4, same-stem captions) into latents, model loading included on both sides:
  ours  `tasks.cache_latents.run` (model=tiny_wan with a bigger VAE, VAE_ARCH) into an empty latents store,
        store writes included (bench.compute.cache_latents_seconds, as figure 1 of bench.run);
  bare  `AutoencoderKLWan.from_pretrained`, then per clip: PyAV decode of every frame, the first `frames`
        taken (data.fps=null: the clip's own rate), PIL bicubic cover-resize + centre crop, stacked to
        [1, 3, F, H, W] in [-1, 1], `encode().latent_dist.mode()`, normalised per channel by the config's
        latents_mean / latents_std, `safetensors.save_file` into a scratch folder.
One clip at a time on both sides, the same dtype (model.dtype) and torch threads, in one process; ours and
bare alternated (bench.common.alternate: an unrecorded warm-up round, then `--reps` rounds), medians.
ratio = bare median / ours median = throughput ours / bare (goal >= 0.95); cpu_ratio: the same over the process's
CPU seconds (all threads), less moved by other load on the machine. Writes bench/video_cache.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from tasks.config import Config
from tasks.plan import Plan


HERE = Path(__file__).resolve().parent
# Wan 2.1's VAE layout (dim_mult 1-2-4-4, 2 res blocks a stage) at a third of its width (96): ~6 M encoder
# parameters, about 3 s per 33-frame 128 px clip on 2 cores, so that encoding dominates as it does for the real one.
VAE_ARCH = {"vae_base_dim": 32, "vae_dim_mult": [1, 2, 4, 4], "vae_num_res_blocks": 2}


def make_clips(folder: Path, n: int, frames: int, size: int, fps: float, seed: int = 0) -> list[Path]:
    """n distinct mp4 clips (a shape crossing a noisy ground, one frame per 1/fps) with same-stem captions."""
    from bench.common import COLOURS, SHAPES
    from tasks.data.clips import write_mp4

    folder.mkdir(parents=True, exist_ok=True)
    rng, names, paths = np.random.default_rng(seed), list(COLOURS), []
    for i in range(n):
        fg, bg = rng.choice(len(names), 2, replace=False)
        shape, r = SHAPES[i % len(SHAPES)], int(size * rng.uniform(0.1, 0.2))
        ground = np.clip(np.array(COLOURS[names[bg]], np.float32) + rng.normal(0, 12, (size, size, 3)), 0, 255)
        (x0, y0), (x1, y1) = rng.integers(r, size - r, (2, 2))
        video = []
        for k in range(frames):
            img = Image.fromarray(ground.astype(np.uint8), "RGB")
            a = k / max(1, frames - 1)
            cx, cy = int(x0 + a * (x1 - x0)), int(y0 + a * (y1 - y0))
            box, colour = (cx - r, cy - r, cx + r, cy + r), COLOURS[names[fg]]
            draw = ImageDraw.Draw(img)
            if shape == "triangle":
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
            else:
                (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=colour)
            video.append(img)
        path = write_mp4(video, folder / f"clip_{i:03d}.mp4", fps)
        path.with_suffix(".txt").write_text(f"a {names[fg]} {shape} moving over a {names[bg]} ground, clip {i}\n")
        paths.append(path)
    return paths


def video_cfg(data_dir: Path, store_root: Path, frames: int, size: int, arch: dict) -> dict:
    """The run config as `python -m flows.train model=tiny_wan ...` composes it, with `arch` on model.arch."""
    from tasks.config import compose, resolve_paths

    prompts = data_dir.parent / "prompts.txt"
    prompts.write_text("a red circle moving right\n")
    cfg = resolve_paths(compose("train", [
        "model=tiny_wan", f"data.dir={data_dir}", f"store.root={store_root}", f"data.resolution={size}",
        f"data.frames={frames}", "data.fps=null", f"sample.prompts_file={prompts}"])[0])
    cfg.model.arch = dict(arch)  # the dict-valued key, set on the composed config (as bench.compute.mid_cfg)
    return cfg


def _cover(img: Image.Image, w: int, h: int) -> Image.Image:
    """Bicubic resize to cover (w, h), keeping the aspect, then the centre crop."""
    s = max(w / img.width, h / img.height)
    nw, nh = max(w, round(img.width * s)), max(h, round(img.height * s))
    img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - w) // 2, (nh - h) // 2
    return img.crop((left, top, left + w, top + h))


def bare_latents(model_dir, clips: list, frames: int, size, dtype: str, out: Path | None = None) -> list:
    """The bare loop: per clip, its normalised latents [16, 1 + (F - 1) / 4, H / 8, W / 8]; saved as
    `out/<i>.safetensors` where `out` is given."""
    import av
    import torch
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    vae = AutoencoderKLWan.from_pretrained(model_dir, subfolder="vae", use_safetensors=True,
                                           dtype=getattr(torch, dtype)).to(device).eval()
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, vae.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(device, vae.dtype)
    w, h = size
    zs = []
    with torch.no_grad():
        for i, path in enumerate(clips):
            with av.open(str(path)) as container:
                decoded = list(container.decode(video=0))[:frames]  # every frame decoded, the first F taken
            arr = np.stack([np.asarray(_cover(f.to_image(), w, h)) for f in decoded])  # [F, H, W, 3] uint8
            x = torch.from_numpy(arr.astype(np.float32) / 127.5 - 1.0).permute(3, 0, 1, 2).contiguous()[None]
            z = (vae.encode(x.to(device, vae.dtype)).latent_dist.mode() - mean) / std
            zs.append(z[0].cpu())
            if out is not None:
                save_file({"latents": zs[-1].contiguous()}, str(out / f"{i}.safetensors"))
    return zs


def bench_video_latents(cfg: Config, plan: Plan, store, scratch: Path, reps: int) -> dict:
    """ours and bare alternated over the plan's clips: seconds per repetition, medians, ratio bare / ours."""
    from bench.common import alternate, median
    from bench.compute import paired_ratios, cache_latents_seconds

    clips = [it["image"] for it in plan.items]
    (frames,), result = {it["clip"]["frames"] for it in plan.items}, {}  # clips of one length only

    def bare() -> float:
        out = scratch / "bare_latents"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        t = time.perf_counter()
        bare_latents(plan.model_dir, clips, frames, plan.size, cfg.model.dtype, out)
        dt = time.perf_counter() - t
        shutil.rmtree(out, ignore_errors=True)
        return dt

    cpu = {"ours": [], "bare": []}  # the process's CPU seconds (all threads) beside each wall time

    def timed(name, fn):
        def call():
            c, wall = time.process_time(), fn()
            cpu[name].append(time.process_time() - c)
            return wall
        return call

    runs = alternate({"ours": timed("ours", lambda: cache_latents_seconds(cfg, plan, store, result)),
                      "bare": timed("bare", bare)}, reps)
    ours_m, bare_m = median(runs["ours"]), median(runs["bare"])
    ours_cpu, bare_cpu = cpu["ours"][1:], cpu["bare"][1:]  # the warm-up round left out, as alternate does
    return {"clips": len(clips), "frames": frames, "size": list(plan.size), "reps": reps,
            "ours_s": runs["ours"], "bare_s": runs["bare"], "ours_median": ours_m, "bare_median": bare_m,
            "ratio": bare_m / ours_m, "paired_ratios": [1 / r for r in paired_ratios(runs)],
            "ours_cpu_s": ours_cpu, "bare_cpu_s": bare_cpu, "cpu_ratio": median(bare_cpu) / median(ours_cpu),
            "latent_keys": result["items"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.video_cache", description=__doc__.split("\n")[0])
    ap.add_argument("--clips", type=int, default=8)
    ap.add_argument("--frames", type=int, default=33, help="frames per clip, 1 + 4k (all of them train)")
    ap.add_argument("--fps", type=float, default=16.0)
    ap.add_argument("--size", type=int, default=128, help="clip side in pixels = data.resolution")
    ap.add_argument("--reps", type=int, default=9, help="recorded rounds after the warm-up round (odd: a true median)")
    ap.add_argument("--tiny-vae", action="store_true", help="tiny_wan's own VAE (development only)")
    ap.add_argument("--out", default=str(HERE / "video_cache.json"))
    args = ap.parse_args(argv)
    from bench.run import bench_env

    load_start, clock0 = os.getloadavg(), time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="loraflow-bench-video-"))
    bench_env(work)  # before anything imports Prefect; HF offline
    from bench import common, compute

    try:
        make_clips(work / "data", args.clips, args.frames, args.size, args.fps)
        arch = {} if args.tiny_vae else VAE_ARCH
        cfg = video_cfg(work / "data", work / "store", args.frames, args.size, arch)
        plan, store = compute.plan_for(cfg)  # builds the model into the store once
        res = bench_video_latents(cfg, plan, store, work, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res.pop("latent_keys")
    machine = {**common.machine_info(), "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
               **{k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}}
    out = {**res, "machine": machine, "fps": args.fps, "vae_arch": arch, "dtype": cfg.model.dtype,
           "goal": ">= 0.95", "meets": res["ratio"] >= 0.95, "bare_writes": "safetensors.save_file per clip",
           "versions": common.versions(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "total_seconds": time.perf_counter() - clock0}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"video latent caching, {res['clips']} clips x {res['frames']} frames at {res['size'][0]}x{res['size'][1]}, "
          f"{res['reps']} rounds: ours {res['ours_median']:.2f} s | bare {res['bare_median']:.2f} s "
          f"({res['clips'] / res['ours_median']:.2f} vs {res['clips'] / res['bare_median']:.2f} clips/s)")
    print(f"ratio ours/bare (throughput) {res['ratio']:.3f}  goal >= 0.95: {'yes' if out['meets'] else 'NO'}  "
          f"(process CPU seconds, bare / ours: {res['cpu_ratio']:.3f}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
