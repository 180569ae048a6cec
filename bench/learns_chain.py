"""Capacity or the chain? For a (family, image) the learning check leaves above its bound (issue 48 item 2).

One LoRA, trained once as `bench.learns` trains it (the CLI, the family's SETTINGS), is rendered by the family's
pipeline as the check renders it ("pipeline"), then again with one declared difference between how the LoRA was
trained and how the pipeline renders removed. Same file, same noise, same sampler: if removing the difference
brings the render error under the bound, the plateau is that difference (the chain), not what the tiny model can
hold (capacity).

LTX-2 ("as_trained"): its video LoRA trains, as Lightricks' ltx-trainer trains one (`with_audio: false`), with
no audio modality, so no audio-to-video attention (tasks/models/ltx2.py: `isolate_modalities=True`); the
pipeline generates audio beside the video and its video tokens attend to it in every block (and its modality
guidance scales that difference by 2). "as_trained" renders with every transformer call isolated.

    python -m bench.learns_chain                        # every model below on every image; learns_chain.json
    python -m bench.learns_chain --images checkers      # one image"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import learns
from bench.learns_images import NAMES as IMAGES

REPO = Path(__file__).resolve().parents[1]


def _isolated(pipe):
    """The LTX-2 pipeline with no cross-modal attention in any of its transformer calls (its modality-isolation
    pass already has none), as its video LoRA was trained."""
    forward = pipe.transformer.forward

    @functools.wraps(forward)
    def isolated(*args, **kwargs):
        kwargs["isolate_modalities"] = True
        return forward(*args, **kwargs)

    pipe.transformer.forward = isolated
    return pipe


# model -> {variant: a change to the loaded pipeline}; "pipeline" (nothing changed) is always rendered first
VARIANTS = {"tiny_ltx2": {"as_trained": _isolated}}


def render(model: str, base: Path, lora: Path, image: str, change=None) -> dict:
    """bench.learns.evaluate's figures for the diffusers file, the pipeline passed through `change`."""
    if change is None:
        r = learns.evaluate(model, base, {"diffusers": lora}, image)
    else:
        load = learns.load_pipeline
        learns.load_pipeline = lambda *a, **k: change(load(*a, **k))
        try:
            r = learns.evaluate(model, base, {"diffusers": lora}, image)
        finally:
            learns.load_pipeline = load
    return {k: round(r[k], 4) for k in ("ratio", "err_lora", "err_base")}


def probe(model: str, image: str) -> dict:
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=f"learns-chain-{model}-{image}-") as tmp:
        root = Path(tmp)
        learns.dataset(root, model, image)
        base, files = learns.train_cli(model, root)
        out = {"pipeline": render(model, base, files["diffusers"], image)}
        for name, change in VARIANTS[model].items():
            out[name] = render(model, base, files["diffusers"], image, change)
    out["seconds"] = round(time.time() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.learns_chain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(VARIANTS), help=f"models ({', '.join(VARIANTS)})")
    ap.add_argument("--images", default=",".join(IMAGES), help=f"comma-separated ({', '.join(IMAGES)})")
    ap.add_argument("--out", default=str(REPO / "bench" / "learns_chain.json"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=learns._machine(),
                  bound=learns.BOUND)
    for model in args.only.split(","):
        for image in args.images.split(","):
            r = probe(model, image)
            result.setdefault(model, {})[image] = r
            print(f"{model} {image}: " + ", ".join(f"{k} {v['ratio']:.3f} (err {v['err_lora']:.4g})"
                                                   for k, v in r.items() if isinstance(v, dict)), flush=True)
            out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
