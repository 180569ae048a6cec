"""The sample node on a stored base (issue 61 item 2): how far samples from a quantized base move from the bf16
base's, on the demo base (data/demo_base, its tiny Flux pretrained on the shape world), with the LoRA a run
trains there.

    python -m bench.sample_quantize [--steps 600] [--out bench/sample_quantize.json]

For each model.quantize (fp8, int8, nf4) a run trains the demo's concept LoRA on that stored base in bf16 (the
demo's settings, fewer steps), and its sample node renders the demo's prompts twice with the same LoRA: as it
now does (the base stored as trained, tasks/training/stored_sampler.py) and from the bf16 base (as before issue
61). Per kind: the mean absolute pixel difference (0-255) and PSNR between the two, and the share of samples the
world's scorer reads as their prompt (tasks/demo/score.py) for each. The bf16 run (quantize none) is the
reference row. Run with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 for numbers that hold on any x86."""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _render_all(adapter, cfg, plan, store, lora_file: Path, text_keys: dict) -> list:
    """The sample node's renders of every prompt with `lora_file` on the base stored as `cfg` says."""
    from tasks import cache_text, sample
    from tasks.training.stored_sampler import load_stored_sampler

    pipe = load_stored_sampler(adapter, cfg, lora_file)
    out = []
    for p in plan.prompts:
        texts = [store.get_tensors(cache_text.KIND, text_keys[n]) if n else None for n in
                 (f"prompt:{p['line']}", f"negative:{p['line']}" if p["negative"] else None, "empty")]
        out.append(sample.render(adapter, pipe, tuple(texts), sample.settings(cfg, plan, p), p))
    return out


def compare(a, b) -> dict:
    import numpy as np

    diffs = [np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)) for x, y in zip(a, b)]
    mse = sum(float((d ** 2).mean()) for d in diffs) / len(diffs)
    return {"mean_abs": sum(float(d.mean()) for d in diffs) / len(diffs), "max_abs": max(float(d.max()) for d in diffs),
            "psnr_db": math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)}


def measure(kind: str, steps: int, root: Path) -> dict:
    from tasks import cache_latents, cache_text, train, validate
    from tasks.config import compose, resolve_paths
    from tasks.demo import score
    from tasks.models import make_adapter
    from tasks.store import Store

    overrides = ["experiment=demo", f"store.root={root / 'store'}", "model.dtype=bfloat16", f"train.max_steps={steps}",
                 "train.log_with=none", "learning.scorer=null", f"model.quantize={kind}"]
    cfg = resolve_paths(compose("train", overrides)[0])
    bf16 = resolve_paths(compose("train", overrides[:-1] + ["model.quantize=none"])[0])
    store = Store(cfg.store.root)
    t0 = time.perf_counter()
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, lat["items"], txt["items"])
    adapter = make_adapter(cfg.model, plan.model_dir)
    stored = _render_all(adapter, cfg, plan, store, Path(lora["lora"]), txt["items"])
    plain = _render_all(adapter, bf16, plan, store, Path(lora["lora"]), txt["items"])
    captions = [p["prompt"] for p in plan.prompts]
    return {"quantize": kind, "steps": steps, "prompts": len(captions), **compare(stored, plain),
            "shown_stored": score.share(stored, captions), "shown_bf16_base": score.share(plain, captions),
            "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--kinds", default="fp8,int8,nf4")
    ap.add_argument("--out", default=str(HERE / "sample_quantize.json"))
    args = ap.parse_args(argv)
    from bench.common import machine_info, versions

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            rows.append(measure(kind, args.steps, Path(tmp)))
            r = rows[-1]
            print(f"{kind:5} stored vs bf16 base: mean |d| {r['mean_abs']:.2f}/255, max {r['max_abs']:.0f}, PSNR "
                  f"{r['psnr_db']:.1f} dB; prompts shown: stored {r['shown_stored']:.2f}, bf16 base "
                  f"{r['shown_bf16_base']:.2f} ({r['seconds']:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps({"machine": machine_info(), "versions": versions(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
