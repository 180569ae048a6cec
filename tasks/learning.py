"""The demo's visible proof that a LoRA learns (`experiment=demo`): the same prompts and seeds rendered by the
base model and with the LoRA, side by side in samples/before_after.png, and scored by the generated world's
own scorer (tasks/demo/score.py) into the report's `learning`:

- concept_before: share of the concept prompts whose base-only render shows the concept (goal <= 0.2)
- concept_after:  the same with the LoRA (goal >= 0.8)
- base_kept:      share of the world's other prompts still rendered right with the LoRA (goal >= 0.8)

Off unless `learning.scorer` names a scorer. It renders from the prompt strings with the family's full
diffusers pipeline (text encoders included), as a user of the LoRA would."""
from __future__ import annotations

import inspect
from pathlib import Path

from tasks.config import Config
from tasks.config_schema import LearningConfig
from tasks.lazy import lazy

torch = lazy("torch")
Image, ImageDraw = lazy("PIL.Image"), lazy("PIL.ImageDraw")  # a no-op run renders nothing

SCORERS = ("shapes",)
_CELL, _PER_ROW = 96, 4  # px per image in before_after.png (upscaled without smoothing); prompts per row


def prompts(lcfg: LearningConfig) -> tuple[list[str], list[str]]:
    """(concept prompts, kept prompts): spread evenly over the world's caption lists (their fixed order), so
    that colours and shapes are all represented, held-out colour pairs of the concept included."""
    from tasks.demo import world

    concept, kept = world.concept_captions(), world.base_captions()
    return concept[:: max(1, len(concept) // lcfg.concept_prompts)][: lcfg.concept_prompts], \
        kept[:: max(1, len(kept) // lcfg.kept_prompts)][: lcfg.kept_prompts]


def _render(pipe, prompt: str, seed: int, lcfg: LearningConfig, size: int) -> Image.Image:
    params = inspect.signature(type(pipe).__call__).parameters
    kw = {k: v for k, v in (("guidance_scale", lcfg.guidance), ("max_sequence_length", lcfg.max_sequence_length))
          if k in params}
    return pipe(prompt=prompt, height=size, width=size, num_inference_steps=lcfg.steps, output_type="pil",
                generator=torch.Generator("cpu").manual_seed(seed), **kw).images[0]


def before_after(rows: list[tuple[str, Image.Image, Image.Image]], out: Path) -> Path:
    """A sheet of prompts, _PER_ROW a row: each prompt above its two images, base (left) | with the LoRA (right)."""
    pair_w, head, gap = 2 * _CELL + 4, 14, 12
    lines = -(-len(rows) // _PER_ROW)
    sheet = Image.new("RGB", (_PER_ROW * (pair_w + gap) + gap, 22 + lines * (head + _CELL + gap)), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((gap, 4), "each prompt: base (left) | with the LoRA (right), same seed", fill="black")
    for i, (prompt, before, after) in enumerate(rows):
        x, y = gap + (i % _PER_ROW) * (pair_w + gap), 22 + (i // _PER_ROW) * (head + _CELL + gap)
        draw.text((x, y), prompt.removeprefix("a "), fill="black")
        for j, img in enumerate((before, after)):
            sheet.paste(img.resize((_CELL, _CELL), Image.NEAREST), (x + j * (_CELL + 4), y + head))
    tmp = out.with_name(out.name + ".tmp")
    sheet.save(tmp, format="PNG")
    tmp.replace(out)
    return out


def run(cfg: Config, model_dir: Path, lora_file: Path, run_dir: Path) -> dict:
    """Render, score, and write <run_dir>/samples/before_after.png; returns the report's `learning`."""
    from tasks.demo import score
    from tasks.models import make_adapter
    from tasks.models.bases.adapter import load_lora_file

    lcfg = cfg.learning
    if lcfg.scorer not in SCORERS:
        from tasks.config import ConfigError

        raise ConfigError(f"learning.scorer={lcfg.scorer!r}: one of {', '.join(SCORERS)} (or null: off)")
    adapter = make_adapter(cfg.model, model_dir)
    size = int(cfg.data.resolution)
    concept, kept = prompts(lcfg)
    renders: dict[str, dict[str, list[Image.Image]]] = {}
    for name, lora in (("base", None), ("lora", lora_file)):
        pipe = adapter.pipeline_cls.from_pretrained(model_dir, dtype=adapter.dtype, use_safetensors=True)
        if lora is not None:
            load_lora_file(pipe, adapter.denoiser_subfolder, lora)
        pipe.set_progress_bar_config(disable=True)
        pipe.to(adapter.device)  # the start noise is drawn on the CPU (_render): the same images on any device
        renders[name] = {p: [_render(pipe, p, s, lcfg, size) for s in lcfg.seeds] for p in concept + kept}

    def share(which: str, texts: list[str]) -> float:
        return score.share([im for t in texts for im in renders[which][t]],
                           [t for t in texts for _ in lcfg.seeds])

    out = run_dir / "samples"
    out.mkdir(parents=True, exist_ok=True)
    seed0 = [(p, renders["base"][p][0], renders["lora"][p][0]) for p in concept + kept]
    path = before_after(seed0, out / "before_after.png")
    return {"concept_before": share("base", concept), "concept_after": share("lora", concept),
            "base_kept": share("lora", kept), "before_after": str(path),
            "prompts": {"concept": len(concept), "kept": len(kept), "seeds": list(lcfg.seeds)}}
