"""Host memory of the train node with complete caches (issue 32): it holds the denoiser, never the VAE or the
text encoders.

    python -m bench.host_memory [--out bench/host_memory.json] [--steps 4] [--arch JSON] [--work DIR] [--keep]

The model is `model=tiny_flux` built by its own builder with a big VAE and big text encoders (`ARCH`, set as
model.arch: the VAE at FLUX.1's size, CLIP 4 x 768, T5 8 layers of T5-large width; about 0.8 GiB of fp32
weights) and bench/common.py's mid-sized transformer (~30 MiB). One process fills the store (tasks.validate.run,
tasks.cache_latents.run, tasks.cache_text.run, the config composed by Hydra as `python -m flows.train` does);
then each measurement runs in a fresh process of its own, so its peak is its own:

    imports         the imports of the nodes (torch, diffusers, transformers, peft, accelerate), the config,
                    validate and the two cache nodes answering from the store: no model loaded
    train           the same, then tasks.train.run (train.max_steps=--steps, a new LoRA: train.seed differs)
    train+encoders  the same, but adapter.load_vae() and adapter.load_text_encoders() first, each weight read once
                    (the loaders memory-map fp32 safetensors: an unread page is not resident) and kept until the
                    end: what a trainer that keeps every component resident holds

Peak RSS is the process's VmHWM (/proc/self/status). resource.getrusage(RUSAGE_SELF).ru_maxrss is reported too,
but on Linux it is kept across fork and exec (signal->maxrss), so a child's value is at least its parent's RSS
at the time it was started; under a big parent (pytest) only VmHWM is the child's own. Each child also counts
calls to the adapter's load_vae / load_text_encoders during train.run (expected: none). Nothing is asserted;
tests/test_bench_host_memory.py runs it on `SMALL_ARCH`.
"""
from __future__ import annotations

from tasks.config import Config
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "tiny_flux"
MODES = ("imports", "train", "train+encoders")
_DENOISER = {"num_layers": 2, "num_single_layers": 2, "attention_head_dim": 64, "num_attention_heads": 4,
             "axes_dims_rope": [16, 24, 24], "latent_channels": 16}  # bench/common.py MID_ARCH's transformer
ARCH = {**_DENOISER, "vae_block_out_channels": [128, 256, 512, 512], "vae_layers_per_block": 2,
        "vae_norm_num_groups": 32, "clip_hidden_size": 768, "clip_layers": 4, "clip_heads": 12,
        "clip_intermediate_size": 3072, "t5_d_model": 1024, "t5_d_kv": 64, "t5_d_ff": 2816, "t5_layers": 8,
        "t5_heads": 16}
SMALL_ARCH = {**_DENOISER, "vae_block_out_channels": [32, 64, 128, 128], "vae_norm_num_groups": 32,
              "clip_hidden_size": 256, "clip_layers": 2, "clip_heads": 4, "clip_intermediate_size": 1024,
              "t5_d_model": 512, "t5_d_kv": 64, "t5_d_ff": 2048, "t5_layers": 4, "t5_heads": 8}
_WEIGHTS = ("vae", "text_encoder", "text_encoder_2", "transformer", "unet")
MIB = 1 << 20


def config(work: Path, arch: dict, steps: int, seed: int = 0) -> dict:
    """The run config as `python -m flows.train` composes it (the demo data, a store under `work`)."""
    from tasks.config import compose, resolve_paths

    cfg = resolve_paths(compose("train", [
        f"model={MODEL}", f"store.root={work / 'store'}", f"train.max_steps={steps}", "train.batch_size=2",
        f"train.seed={seed}", "train.log_with=none", "sample.every_n_steps=0"])[0])
    cfg.model.arch = dict(arch)  # the dict-valued key, set on the composed config (as bench/compute.py)
    return cfg


def cached_nodes(cfg: Config):
    """validate, cache_latents, cache_text as the flow runs them: (plan, store, latent keys, text keys, computed)."""
    from tasks import cache_latents, cache_text, validate
    from tasks.store import Store

    store = Store(cfg.store.root)
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    return plan, store, lat["items"], txt["items"], lat["computed"] + txt["computed"]


def peaks() -> dict:
    """This process's peak RSS in MiB: VmHWM and ru_maxrss (KiB on Linux)."""
    status = Path("/proc/self/status").read_text().split("\n")
    hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return {"vm_hwm": hwm / 1024, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def component_mib(model_dir: Path) -> dict:
    """Weight bytes (safetensors files) of each component folder of the model, in MiB."""
    sizes = {name: sum(f.stat().st_size for f in (Path(model_dir) / name).glob("*.safetensors")) / MIB
             for name in _WEIGHTS if (Path(model_dir) / name).is_dir()}
    return {name: round(mib, 1) for name, mib in sizes.items()}


def measure(mode: str, work: Path, arch: dict, steps: int) -> dict:
    """One measurement; run it in a fresh process (`--child`). "fill" computes the caches instead."""
    import accelerate  # noqa: F401 -- the same imports in every mode (train.run imports these two late)
    import peft  # noqa: F401
    import torch

    from tasks import train
    from tasks.models import adapter_class, make_adapter

    cfg = config(work, arch, steps, seed=MODES.index(mode) if mode in MODES else 0)
    plan, store, lat, txt, computed = cached_nodes(cfg)
    if mode == "fill":
        return {"components_mib": component_mib(Path(plan.model_dir)), "cached": computed}
    held = []
    if mode == "train+encoders":
        adapter = make_adapter(cfg.model, plan.model_dir)
        held = [adapter.load_vae(), adapter.load_text_encoders()]
        for module in [held[0], *(m for m in vars(held[1]).values() if isinstance(m, torch.nn.Module))]:
            for w in module.state_dict().values():  # memory-mapped until read: read once, as encoding would
                w.sum()
    cls, calls = adapter_class(cfg.model.family), {"load_vae": 0, "load_text_encoders": 0}
    for name in calls:
        setattr(cls, name, _counted(getattr(cls, name), calls, name))
    trained = 0
    if mode != "imports":
        trained = train.run(cfg, plan, store, lat, txt)["computed"]
    return {**peaks(), "cached_computed": computed, "trained": trained, "loads_during_train": calls,
            "held": len(held)}


def _counted(load, calls: dict, name: str):
    def counted(self):
        calls[name] += 1
        return load(self)
    return counted


def spawn(mode: str, work: Path, arch: dict, steps: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "bench.host_memory", "--child", mode, "--work", str(work), "--arch",
           json.dumps(arch), "--steps", str(steps)]
    out = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{mode}: exit {out.returncode}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(arch: dict, components: dict, runs: dict) -> dict:
    peak = {mode: round(runs[mode]["vm_hwm"], 1) for mode in MODES}
    return {"family": MODEL, "arch": arch, "components_mib": components, "peak_rss_mib": peak,
            "train_minus_imports_mib": round(peak["train"] - peak["imports"], 1),
            "encoders_would_add_mib": round(peak["train+encoders"] - peak["train"], 1),
            "ru_maxrss_mib": {mode: round(runs[mode]["ru_maxrss"], 1) for mode in MODES},
            "loads_during_train": {mode: runs[mode]["loads_during_train"] for mode in MODES},
            "trained": {mode: runs[mode]["trained"] for mode in MODES}}


def table(result: dict) -> str:
    c, p = result["components_mib"], result["peak_rss_mib"]
    encoders = sum(v for k, v in c.items() if k not in ("transformer", "unet"))
    rows = [("component weights (fp32 safetensors)", "MiB"), *((f"  {k}", f"{v:.1f}") for k, v in c.items()),
            ("  VAE + text encoders", f"{encoders:.1f}"), ("peak RSS (VmHWM)", "MiB"),
            *((f"  {m}", f"{p[m]:.1f}") for m in MODES),
            ("train - imports", f"{result['train_minus_imports_mib']:.1f}"),
            ("train+encoders - train", f"{result['encoders_would_add_mib']:.1f}")]
    return "\n".join(f"{a:<40} {b:>10}" for a, b in rows)


def run_bench(work: Path, arch: dict, steps: int = 4) -> dict:
    """Fill the caches in one process, then one fresh process per mode."""
    filled = spawn("fill", work, arch, steps)
    runs = {mode: spawn(mode, work, arch, steps) for mode in MODES}
    return summarize(arch, filled["components_mib"], runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "host_memory.json")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--work", type=Path, help="keep the store here (reused on the next call)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    p.add_argument("--arch", help="model.arch as JSON instead of ARCH, e.g. '{}' for the default tiny_flux")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # one measurement, its result as the last line of stdout
        print(json.dumps(measure(args.child, args.work, json.loads(args.arch), args.steps)))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="loraflow-host-memory-"))
    try:
        result = run_bench(work, ARCH if args.arch is None else json.loads(args.arch), args.steps)
    finally:
        if not (args.work or args.keep):
            shutil.rmtree(work, ignore_errors=True)
    print(table(result))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
