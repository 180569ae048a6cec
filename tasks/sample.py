"""Node sample: one image per sample prompt, rendered with the trained LoRA from cached prompt embeddings (with
train.text_encoder_lr: from prompts encoded here by the text encoders with the LoRA file's encoder layers)."""
from __future__ import annotations

import logging
import re
from pathlib import Path

from tasks import cache_text
from tasks.config import Config
from tasks.data import controls, prompts
from tasks.data.clips import Video, read_frames, write_mp4
from tasks.items import check_items, node_result, progress
from tasks.lazy import lazy
from tasks.models import make_adapter
from tasks.models.bases.adapter import on_pipeline_device
from tasks.models.lora_variants import text_encoder_lora as te_lora
from tasks.plan import Plan
from tasks.runtime import runtime
from tasks.store import Store
from tasks.store.hashing import key_of
from tasks.training.stored_sampler import stored_key

Image = lazy("PIL.Image")  # a no-op run renders no sample (tasks/lazy.py)

CODE_VERSION = "1"
KIND = "samples"
log = logging.getLogger("loraflow")


settings = prompts.sample_settings  # a prompt's own kohya options over the sample.* defaults


def prompt_inputs(cfg: Config, plan: Plan, text_keys: dict[str, str]) -> dict[str, dict]:
    """What each prompt's image depends on besides the LoRA (its settings, texts and the sampler)."""
    base = {"node": "sample", "code": CODE_VERSION, "model": plan.ids["sample"],
            "dtype": cfg.model.dtype, "family": plan.family, **stored_key(cfg), **runtime()}
    if te_lora.enabled(cfg):
        # Encoded live (nothing cached): each text by its cache key (the text and the encoders' identity); the
        # LoRA's key covers the encoders' LoRA.
        base["text_encoding"] = "live"
        key = lambda text: cache_text.text_key(cfg, plan, text)  # noqa: E731
        text_keys = {"empty": key(""), **{f"{kind}:{p['line']}": key(p[kind]) for p in plan.prompts
                                          for kind in ("prompt", "negative") if p[kind]}}
    return {f"prompt:{p['line']}": {**base, **settings(cfg, plan, p), "prompt": text_keys[f"prompt:{p['line']}"],
                                    "negative": text_keys.get(f"negative:{p['line']}"), "empty": text_keys[empty_name(p, text_keys)],
                                    **control_inputs(p)}
            for p in plan.prompts}


def empty_name(prompt: dict, text_keys: dict) -> str:
    """The empty prompt a sample reads: its own where the text encoder sees its --i images (cache_text)."""
    own = f"empty:prompt:{prompt['line']}"
    return own if own in text_keys else "empty"


def control_inputs(prompt: dict) -> dict:
    """A prompt's --i control images in its key, by content ({} without: keys stay as they were)."""
    return {"images": [digest for _, digest in prompt["images"]]} if prompt.get("images") else {}


def render(adapter, pipe, texts: tuple, s: dict, prompt: dict):
    """One sample from cached texts (prompt, negative, empty) with settings `s`; for an edit family with the
    prompt's --i control images, fitted to the sample's size as its pairs trained, and saved beside them."""
    images = [controls.fitted(f, s["width"], s["height"]) for f, _ in prompt.get("images", [])]
    image = adapter.sample(pipe, *(on_pipeline_device(pipe, t) for t in texts), **s,
                           **({"controls": images} if images else {}))
    # a clip rendered from its first frame starts with it: saved as rendered
    return controls.beside(images, image) if images and not isinstance(image, Video) else image


def item_keys(cfg: Config, plan: Plan, lora_key: str, text_keys: dict[str, str]) -> dict[str, str]:
    return {name: key_of({**inputs, "lora": lora_key}) for name, inputs in prompt_inputs(cfg, plan, text_keys).items()}


def inputs(cfg: Config, plan: Plan, lora_key: str, text_keys: dict[str, str]) -> dict:
    # per prompt without the LoRA: a new LoRA is reported as `lora` alone, not as every prompt too
    return {"node": "sample", "code": CODE_VERSION, "lora": lora_key,
            **{name: key_of(i) for name, i in prompt_inputs(cfg, plan, text_keys).items()}}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:40] or "prompt"


def save_sample(result, folder) -> Path:
    """A rendered sample as a file in `folder`: an image as PNG; a video family's Video as an H.264 mp4."""
    if isinstance(result, Video):
        return write_mp4(result.frames, Path(folder) / "sample.mp4", result.fps)
    path = Path(folder) / "sample.png"
    result.save(path)
    return path


def preview(path) -> Image.Image:
    """A sample file as one picture: the image, or a video's first frame."""
    if Path(path).suffix == ".mp4":
        return Image.fromarray(read_frames(path, 1)[0])
    with Image.open(path) as image:
        return image.convert("RGB")


GRID_CELL = 192  # px: a grid cell's least width, so its label is readable under tiny samples (upscaled, unsmoothed)
LABEL_LINES = 2  # a cell's label: the prompt (cut to fit), then its seed and size


def fit(draw, text: str, width: int) -> str:
    """`text` cut (with an ellipsis) to `width` px in the draw's font."""
    if draw.textlength(text) <= width:
        return text
    while text and draw.textlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def make_grid(images: list[Path], out: Path, columns: int = 4, labels: list[list[str]] | None = None) -> Path:
    """The samples side by side (a video's first frame): a quick look at a run. `labels`: per sample, the lines
    written above it (its prompt, its seed), each cut to the cell's width. Written under a temporary name."""
    from PIL import ImageDraw

    tiles = [preview(p) for p in images]
    w, h = max(t.width for t in tiles), max(t.height for t in tiles)
    scale = max(1, -(-GRID_CELL // w)) if labels else 1
    w, h = w * scale, h * scale
    head = 4 + 12 * LABEL_LINES if labels else 0
    cols = min(columns, len(tiles))
    grid = Image.new("RGB", (cols * w, ((len(tiles) + cols - 1) // cols) * (h + head)), "white")
    draw = ImageDraw.Draw(grid)
    for i, t in enumerate(tiles):
        x, y = (i % cols) * w, (i // cols) * (h + head)
        for j, line in enumerate((labels[i] if labels else [])[:LABEL_LINES]):
            draw.text((x + 3, y + 2 + 12 * j), fit(draw, line, w - 6), fill="black")
        grid.paste(t.resize((t.width * scale, t.height * scale), Image.NEAREST), (x, y + head))
    tmp = out.with_name(f".{out.name}.tmp")
    grid.save(tmp, format="PNG")
    tmp.replace(out)
    return out


def grid_labels(cfg: Config, plan: Plan) -> list[list[str]]:
    """Each prompt's label in the grid: its text (the negative after `--n`), then its seed and size."""
    out = []
    for p in plan.prompts:
        s = settings(cfg, plan, p)
        text = p["prompt"] + (f" --n {p['negative']}" if p["negative"] else "")
        out.append([text, f"seed {s['seed']}, {s['width']}x{s['height']}, {s['steps']} steps"])
    return out


def run(cfg: Config, plan: Plan, store: Store, lora_key: str, lora_file: str, text_keys: dict) -> dict:
    keys = item_keys(cfg, plan, lora_key, text_keys)
    status = check_items(store, KIND, keys.values())
    if status.missing:
        adapter = make_adapter(cfg.model, plan.model_dir)
        live = te_lora.enabled(cfg)  # the LoRA file has text-encoder layers: the pipeline keeps its encoders
        from tasks.training.stored_sampler import load_stored_sampler  # torch: only when rendering

        # the denoiser stored as training stored it (model.quantize), offloaded with sample.offload
        pipe = load_stored_sampler(adapter, cfg, Path(lora_file), **({"text_encoders": True} if live else {}))

        def tensors(name: str, text: str) -> dict:
            if live:  # by the pipeline's encoders, which hold the LoRA file's text-encoder layers
                return adapter.encode_text(pipe, [text])[0]
            return store.get_tensors(cache_text.KIND, text_keys[name])

        todo = set(status.missing)
        for p in progress(plan.prompts, "sample"):
            key = keys[f"prompt:{p['line']}"]
            if key not in todo:
                continue
            todo.discard(key)
            s = settings(cfg, plan, p)
            prompt = tensors(f"prompt:{p['line']}", p["prompt"])
            negative = tensors(f"negative:{p['line']}", p["negative"]) if p["negative"] else None
            empty = tensors(empty_name(p, text_keys), "")
            result = render(adapter, pipe, (prompt, negative, empty), s, p)
            with store.tmp_dir("sample") as tmp:
                store.put_file(KIND, key, save_sample(result, tmp), meta={"prompt": p["prompt"], **s})
        log.info("sample: rendered %d sample(s), reused %d", len(status.missing), len(status.reused))

    node_inputs = inputs(cfg, plan, lora_key, text_keys)
    samples = [str(store.get_path(KIND, keys[f"prompt:{p['line']}"])) for p in plan.prompts]
    return node_result(key_of(node_inputs), keys, status, node_inputs, samples=samples)


def key_of_node(cfg: Config, plan: Plan, lora_key: str, text_keys: dict) -> str:
    return key_of(inputs(cfg, plan, lora_key, text_keys))
