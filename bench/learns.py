"""Does a LoRA learn? One image, memorised, then rendered back by each family's own diffusers pipeline.

For each family: train through loraflow on one 64 px image (its caption repeated 4 times a batch) until the
LoRA memorises it; load every exported file into the family's diffusers pipeline, built from the run's base
folder with `from_pretrained`; render the caption from noise; compare the latent the pipeline hands to
`vae.decode` with the training image's own latent (`vae.encode(...).latent_dist.mode()`, computed here, not
read from loraflow's cache, so a cache that scales or shifts wrongly shows):

    err = mean((decoded_input - image_latent)^2),   ratio = err_lora / err_base   (goal: <= 0.2)

The reference is a function of the pipeline alone: a sign, timestep convention, latent scale/shift, key name
or alpha/rank scale that loraflow gets wrong makes the LoRA pull the render somewhere else, and the ratio
rises (tests/test_learns.py and tests/test_learns_mutations.py mutate each; docs/learning.md says where each
is caught and what is not).

    python -m bench.learns                  # the demo and every family, ~10 min on 2 cores; learns.json + RESULTS.md
    python -m bench.learns --only tiny_flux,tiny_sd15   [--out FILE]

A file diffusers cannot read goes through `merge` instead (W += alpha/rank * up @ down on the original
checkpoint's fused Linear, ComfyUI's rule): the kohya files of SD3 (diffusers' SD3 pipeline reads no kohya
layout) and Flux (diffusers' converter hard-codes FLUX.1's widths for single-block linear1)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench.file_mutations import FILE_MUTATIONS
from bench.learns_images import NAMES as IMAGES, generated
from bench.learns_loaders import MERGED, denoiser_of, load_diffusers_file, load_pipeline, merge_kohya, model_family
from bench.learns_report import BOUND, BOUNDS, RENDER_STEPS, bound, write_results  # noqa: F401
from bench.learns_report import shown as _shown
from bench.learns_settings import SETTINGS  # per family; tests read learns.SETTINGS

REPO = Path(__file__).resolve().parents[1]
CAPTION = "a red circle on a blue background"
SIZE = 64
REPEATS = 4  # copies of the one image per epoch = the batch: 4 noise draws per step
SEED = 0  # the render's noise


def training_image(model: str, image: str = "demo") -> tuple[Image.Image, str]:
    """The one image and its caption: a demo image, or for the demo base a shape it has never seen (a world
    image it knows would leave the LoRA nothing to learn); `image`: a generated one (bench/learns_images.py)."""
    if image != "demo":
        return generated(image, SIZE)
    if model == "demo_flux":
        from tasks.demo import world

        caption = world.caption(world.CONCEPT, "red", "blue")
        return world.render(*world.parse(caption)), caption
    img = Image.open(REPO / "data" / "demo" / "img_00.png").convert("RGB").resize((SIZE, SIZE), Image.BICUBIC)
    return img, CAPTION


FRAMES = 9  # a video family's clip: 1 + 4k frames (Wan: 3 latent frames; LTX-2, 1 + 8k: 2)
CLIP_FPS = 16


def training_clip(model: str, image: str = "demo") -> list[Image.Image]:
    """A video family's clip: the training image sliding 4 px right a frame (wrapping round)."""
    img = training_image(model, image)[0]
    return [Image.fromarray(np.roll(np.asarray(img), 4 * k, axis=1)) for k in range(FRAMES)]


# (model, image) -> the clip dataset() last wrote: evaluate() reads the bytes the run trained on, since the same
# frames do not always encode to the same mp4 bytes (docs/learning.md)
_WRITTEN: dict[tuple[str, str], Path] = {}


def dataset(root: Path, model: str, image: str = "demo") -> Path:
    """The one training image, exactly SIZE px (no resize: its latent here is the cache's), and its caption;
    a video family's: one clip at SIZE px."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    img, caption = training_image(model, image)
    if SETTINGS.get(model, {}).get("clip"):
        from tasks.data.clips import write_mp4

        write_mp4(training_clip(model, image), data / "img.mp4", fps=CLIP_FPS)
        _WRITTEN[(model, image)] = data / "img.mp4"
        if SETTINGS[model].get("i2v"):  # rendered from the first frame loraflow reads (after H.264)
            first_frame(data / "img.mp4").save(root / "first.png")
            (root / "prompts.txt").write_text(caption + " --i first.png\n")
            (data / "img.txt").write_text(caption + "\n")
            return data
    else:
        img.save(data / "img.png")
    (data / "img.txt").write_text(caption + "\n")
    (root / "prompts.txt").write_text(caption + "\n")
    if control := control_image(model, image):  # an edit family's pair: the control by the target's stem
        (root / "control").mkdir(exist_ok=True)
        control.save(root / "control" / "img.png")
        (root / "prompts.txt").write_text(caption + " --i control/img.png\n")
    return data


def first_frame(clip: Path) -> Image.Image:
    from tasks.data.clips import read_frames

    return Image.fromarray(read_frames(clip, 1)[0])


def control_image(model: str, image: str = "demo") -> Image.Image | None:
    """An edit family's control image (the training image's negative), or None."""
    if not SETTINGS.get(model, {}).get("control"):
        return None
    from PIL import ImageOps

    return ImageOps.invert(training_image(model, image)[0])


def overrides(model: str, root: Path, settings: dict | None = None) -> list[str]:
    """The run's Hydra overrides: the same for the CLI (bench) and for the node functions (tests)."""
    s = settings or SETTINGS[model]
    arch = [f"+model.arch.{k}={json.dumps(v)}" for k, v in s["arch"].items()]  # keys of the builder's arch
    return [f"model={model.split('+')[0]}", *arch, *([f"train.network={s['network']}"] if s.get("network") else []), f"data.subsets=[{{dir: {root / 'data'}, repeats: {s.get('batch', REPEATS)}}}]",
            f"data.resolution={SIZE}", f"train.batch_size={s.get('batch', REPEATS)}", f"train.rank={s['rank']}",
            f"train.max_steps={s['steps']}", f"train.lr={s['lr']}", f"train.lr_scheduler={s.get('lr_scheduler', 'cosine')}",
            *([f"train.target_modules=[{','.join(s['targets'])}]"] if s.get("targets") else []),
            *([f"data.control_dirs=[{root / 'control'}]"] if s.get("control") else []),
            *([f"data.frames={FRAMES}"] if s.get("clip") else []),
            *([f"model.expert={s['expert']}"] if s.get("expert") else []),
            *([f"model.quantize={s['quantize']}", "model.dtype=bfloat16"] if s.get("quantize") else []),
            *([f"model.matmul={s['matmul']}"] if s.get("matmul") else []),
            "train.log_every=25", "train.log_with=none",
            f"sample.prompts_file={root / 'prompts.txt'}", "sample.steps=2", "export.format=both",
            f"store.root={root / 'store'}"]


def train_cli(model: str, root: Path, settings: dict | None = None) -> tuple[Path, dict[str, Path]]:
    """Train through the CLI, as a user does; (base folder, {format: LoRA file}) from its report.json."""
    run_dir = root / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(root / "prefect")}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "flows.train", *overrides(model, root, settings), f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{model}: the CLI run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    report = json.loads((run_dir / "report.json").read_text())
    files = {fmt: Path(p) for fmt, p in report["artifacts"]["lora_files"].items()}
    for same in ("kohya", "lycoris"):  # the kohya (LyCORIS) file is ComfyUI's there: evaluated once
        if same in files and files.get("comfyui") == files[same]:
            files.pop("comfyui")
    return Path(report["artifacts"]["base_model"]), files


def train_nodes(model: str, root: Path, settings: dict | None = None) -> tuple[Path, dict[str, Path]]:
    """The same run at the node functions, in this process (no Prefect): what the tests use, so that a
    mutation monkeypatched into loraflow's code is the code that trains."""
    from tasks import cache_latents, cache_text, publish, train, validate
    from tasks.config import compose, resolve_paths
    from tasks.store import Store

    cfg = resolve_paths(compose("train", overrides(model, root, settings))[0])
    store = Store(root / "store")
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, lat["items"], txt["items"])
    if cfg.train.network in ("loha", "lokr"):
        return Path(plan.model_dir), {"lycoris": publish.lycoris_file(cfg, plan, store, lora)}
    files = {"diffusers": publish.diffusers_file(store, lora), "kohya": publish.kohya_file(cfg, plan, store, lora)}
    return Path(plan.model_dir), files


# -- evaluation ---------------------------------------------------------------------------------------------


def _call_kwargs(pipe, text_tokens: int) -> dict:
    """No classifier-free guidance anywhere (the LoRA learned the conditional prediction); the distilled
    guidance of Flux and FLUX.2 [dev] at train.guidance's default (1.0), as trained; the text window the tiny model
    trained with (its model.max_sequence_length)."""
    import inspect

    params = inspect.signature(type(pipe).__call__).parameters
    kw = {"guidance_scale": 1.0} if "guidance_scale" in params else {}  # HunyuanVideo 1.5: its guider's (loaders)
    if "true_cfg_scale" in params:
        kw["true_cfg_scale"] = 1.0
    if "max_sequence_length" in params:
        kw["max_sequence_length"] = text_tokens
    if "frame_rate" in params:  # LTX-2: the clip's rate (its RoPE's time axis, as trained)
        kw["frame_rate"] = float(CLIP_FPS)
    return kw


def render_latent(pipe, prompt: str, family: str, seed: int = SEED, steps: int = RENDER_STEPS, control=None,
                  frames: int | None = None, text_tokens: int = 32):
    """The latent the pipeline hands to vae.decode, rendering `prompt` from the noise of `seed`."""
    import inspect

    from tasks.models import adapter_class

    import torch

    seen = []
    decode = pipe.vae.decode
    size = dict(height=SIZE, width=SIZE)
    if "height" not in inspect.signature(type(pipe).__call__).parameters:  # HunyuanVideo 1.5 I2V: sized from the
        pipe.target_size = SIZE  # image, the bucket of this area nearest its aspect ratio: SIZE x SIZE for a square
        size = {}

    def spy(z, *a, **kw):
        seen.append(z.detach().clone())
        return decode(z, *a, **kw)

    pipe.vae.decode = spy
    try:
        edit = {} if control is None else adapter_class(family).reference_controls(control, SIZE)
        if frames:  # a video pipeline
            edit["num_frames"] = frames
        pipe(prompt=prompt, **size, num_inference_steps=steps, output_type="np",
             generator=torch.Generator("cpu").manual_seed(seed), **_call_kwargs(pipe, text_tokens), **edit)
    finally:
        pipe.vae.decode = decode
    assert len(seen) == 1, f"{type(pipe).__name__}: vae.decode called {len(seen)} times"
    return seen[0].float().flatten()


def image_latent(pipe, image: Image.Image | list):
    """The training image's latent as the VAE encodes it (the mode, as loraflow caches it), unscaled; a clip's
    (a list of frames): [1, 3, F, H, W] through the video VAE."""
    import torch

    def pixels(img):
        return torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
    if isinstance(image, list):
        x = torch.stack([pixels(f) for f in image], dim=1)[None]
    else:
        x = pixels(image)[None]
    if type(pipe.vae).__name__ == "AutoencoderKLQwenImage21":  # RGBA pixels: opaque, as loraflow encodes them
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    if type(pipe.vae).__name__ in ("AutoencoderKLQwenImage", "AutoencoderKLQwenImage21"):  # a video VAE: one frame
        x = x[:, :, None]
    with torch.no_grad():
        return pipe.vae.encode(x.to(pipe.vae.dtype)).latent_dist.mode().float().flatten()


def mutated(model: str, base: Path, files: dict[str, Path], work: Path) -> dict[str, dict[str, float | str]]:
    """The ratio of each file mutation of each exported file; caught: over the model's bound, or the loader
    refuses the file (recorded as "refused: <its error>")."""
    out = {}
    for name, mutate in FILE_MUTATIONS.items():
        out[name] = {}
        for fmt, file in files.items():
            bad = work / f"{name}_{fmt}.safetensors"
            mutate(file, bad)
            try:
                out[name][fmt] = evaluate(model, base, {fmt: bad})["files"][fmt]
            except Exception as e:  # noqa: BLE001 - any loader error: the file is refused, loudly
                out[name][fmt] = f"refused: {type(e).__name__}: {str(e)[:120]}"
    return out


def evaluate(model: str, base: Path, files: dict[str, Path], image: str = "demo") -> dict:
    """err_base, err_lora (the diffusers file), ratio, and the ratio of every exported file."""
    i2v = SETTINGS.get(model, {}).get("i2v")
    family, text_tokens = model_family(model)
    pipe = load_pipeline(base, model)
    name, (image, caption) = image, training_image(model, image)
    clip = SETTINGS.get(model, {}).get("clip")
    if clip:  # the clip as decoded from its mp4 (what loraflow encoded), not the frames before H.264
        from tasks.data.clips import read_frames, write_mp4

        with tempfile.TemporaryDirectory() as tmp:
            written = _WRITTEN.get((model, name))
            if written is None or not written.exists():
                written = write_mp4(training_clip(model, name), Path(tmp) / "c.mp4", fps=CLIP_FPS)
            decoded = read_frames(written, FRAMES)
        image = [Image.fromarray(f) for f in decoded]
    target = image_latent(pipe, image)
    control = image[0] if i2v else control_image(model, name)  # image-to-video: from the clip's first frame
    frames = FRAMES if clip else None
    err_base = float(((render_latent(pipe, caption, family, control=control, frames=frames, text_tokens=text_tokens) - target) ** 2).mean())
    ratios, errs, loaders = {}, {}, {}
    for fmt, file in sorted(files.items()):
        pipe = load_pipeline(base, model)
        merge = (fmt == "kohya" and type(pipe).__name__ in MERGED) or fmt == "comfyui"
        loaders[fmt] = "merge" if merge else "load_lora_weights"
        if fmt == "lycoris":
            from tasks.models.lora_variants.lycoris import apply_lycoris

            loaders[fmt] = "ComfyUI's LoHa/LoKr rule (apply_lycoris)"
            apply_lycoris(denoiser_of(pipe), file)
        elif merge:
            merge_kohya(pipe, file, model.removeprefix("tiny_").removeprefix("demo_").split("+")[0]
                        if fmt == "comfyui" else None)
        else:
            expert = SETTINGS.get(model, {}).get("expert")  # Wan 2.2: the expert(s) the LoRA was trained on
            if expert != "low":
                load_diffusers_file(pipe, file)
            if expert in ("low", "both"):
                pipe.load_lora_weights(str(file), load_into_transformer_2=True)
        errs[fmt] = float(((render_latent(pipe, caption, family, control=control, frames=frames, text_tokens=text_tokens) - target) ** 2).mean())
        ratios[fmt] = errs[fmt] / err_base
    main = "diffusers" if "diffusers" in files else sorted(files)[0]
    return {"err_base": err_base, "err_lora": errs[main], "ratio": ratios[main], "files": ratios, "loaders": loaders}


def demo(root: Path) -> dict:
    """`make run`'s demo through the CLI (experiment=demo), in its own store: the report's `learning`."""
    run_dir = root / "demo"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(root / "prefect")}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "flows.train", "experiment=demo", f"store.root={root / 'store'}",
           f"hydra.run.dir={run_dir}"]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"demo: the CLI run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    learning = json.loads((run_dir / "report.json").read_text())["learning"]
    return {k: learning[k] for k in ("concept_before", "concept_after", "base_kept")} | {
        "seconds": round(time.time() - t0, 1)}


def _machine() -> str:
    import platform

    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()} kernels)")


def on_images(model: str, images: list[str]) -> dict[str, float]:
    """{generated image: the diffusers file's ratio} of the model trained and rendered on each (issue 48)."""
    out = {}
    for name in images:
        with tempfile.TemporaryDirectory(prefix=f"learns-{model}-{name}-") as tmp:
            root = Path(tmp)
            dataset(root, model, name)
            base, files = train_cli(model, root)
            out[name] = evaluate(model, base, files, name)["ratio"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.learns", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated model names, or demo (default: the demo and every model)")
    ap.add_argument("--out", default=str(REPO / "bench" / "learns.json"))
    ap.add_argument("--images", default="all", help="generated images each model is also checked on (bench/"
                    f"learns_images.py: {', '.join(IMAGES)}), comma-separated, all, or none")
    args = ap.parse_args(argv)
    images = list(IMAGES) if args.images == "all" else [] if args.images == "none" else args.images.split(",")
    models = args.only.split(",") if args.only else ["demo", *SETTINGS]
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {"families": {}}
    result.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=_machine())
    for model in models:
        if model == "demo":
            with tempfile.TemporaryDirectory(prefix="learns-demo-") as tmp:
                result["demo"] = demo(Path(tmp))
            print(f"demo: {result['demo']}", flush=True)
            continue
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix=f"learns-{model}-") as tmp:
            root = Path(tmp)
            dataset(root, model)
            base, files = train_cli(model, root)
            r = evaluate(model, base, files)
            r["mutations"] = mutated(model, base, files, root)
        r["settings"] = {**SETTINGS[model], "batch": SETTINGS[model].get("batch", REPEATS), "size": SIZE, "render_steps": RENDER_STEPS,
                         "seconds": round(time.time() - t0, 1)}
        if images:  # else the last figures stay (--images none)
            r["images"] = on_images(model, images)
        elif "images" in result["families"].get(model, {}):
            r["images"] = result["families"][model]["images"]
        result["families"][model] = r
        print(f"{model}: ratio {r['ratio']:.3f} (err {r['err_lora']:.4g} / {r['err_base']:.4g}), files "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["files"].items()) + f", {r['settings']['seconds']} s; "
              + "; ".join(f"{m} " + ", ".join(f"{k} {_shown(v, model)}" for k, v in fs.items())
                          for m, fs in r["mutations"].items())
              + "; images " + ", ".join(f"{k} {v:.3f}" for k, v in r.get("images", {}).items()), flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    if out == REPO / "bench" / "learns.json":
        write_results(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
