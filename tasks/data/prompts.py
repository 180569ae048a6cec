"""Parse kohya-style sample-prompt files.

One prompt per line: the prompt text, then options introduced by " --":
  --n <negative text>  --w <width>  --h <height>  --s <steps>
  --l <guidance scale>  --g <true CFG scale>  --d <seed>
  --i <control image>  (repeatable: an edit family's reference image(s); relative to the prompts file's folder)
  --f <frames>  (a video family's frame count, as musubi-tuner's prompt files; default data.frames)
Blank lines and lines starting with '#' are ignored. Pure core: no prefect/hydra.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from tasks.config_schema import Config
from tasks.plan import Plan


@dataclass(frozen=True)
class SamplePrompt:
    line: int
    prompt: str
    negative: str = ""
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance: float | None = None  # --l
    true_cfg: float | None = None  # --g
    seed: int | None = None  # --d
    images: tuple[str, ...] = ()  # --i, repeatable: control images of edit families
    frames: int | None = None  # --f: a video family's frame count


class PromptLineError(ValueError):
    """A sample-prompt line is malformed; names the line and the offending option."""

    def __init__(self, line: int, reason: str, option: str | None = None):
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason, self.option = line, reason, option


# option letter -> (SamplePrompt field, kind)
_OPTIONS = {
    "n": ("negative", "text"),
    "w": ("width", "positive int"),
    "h": ("height", "positive int"),
    "s": ("steps", "positive int"),
    "l": ("guidance", "float"),
    "g": ("true_cfg", "float"),
    "d": ("seed", "seed"),
    "i": ("images", "path"),
    "f": ("frames", "positive int"),
}
_OPTION_RE = re.compile(r"([A-Za-z]+)(?:\s+(.*))?$", re.S)
_INT_RE = re.compile(r"[+-]?\d+")
# Upper bounds of what the samplers can run (check_config uses the same for sample.*): the DDIM scheduler
# (tiny_sd15) refuses more steps than its 1000 training timesteps; torch.Generator.manual_seed takes
# 0..2**64-1; a side above 16384 px is no image any family renders (and 10**30 overflows tensor shapes).
MAX_SIDE, MAX_STEPS, MAX_SEED = 16384, 1000, 2**64 - 1
MAX_FRAMES = 1025  # LTX-2's longest (257 latent frames); Wan's is 81
_MAX = {"w": MAX_SIDE, "h": MAX_SIDE, "s": MAX_STEPS, "d": MAX_SEED, "f": MAX_FRAMES}


def _convert(value: str, kind: str, opt: str, line: int):
    if kind == "text":
        return value
    if kind == "path":
        if not value:
            raise PromptLineError(line, f"option --{opt} needs an image path", opt)
        return value
    if not value:
        raise PromptLineError(line, f"option --{opt} needs a value", opt)
    if kind in ("positive int", "seed"):
        # Strict pattern: int() would also accept "1_000".
        if not _INT_RE.fullmatch(value):
            raise PromptLineError(line, f"option --{opt} expects an integer, got {value!r}", opt)
        try:
            n = int(value)
        except ValueError:  # over 4300 digits (Python's int-parsing limit)
            raise PromptLineError(line, f"option --{opt}: a {len(value)}-digit number is out of range", opt) from None
        if kind == "positive int" and n <= 0:
            raise PromptLineError(line, f"option --{opt} must be a positive integer, got {n}", opt)
        if kind == "seed" and n < 0:
            raise PromptLineError(line, f"option --{opt} (seed) must be >= 0, got {n}", opt)
        if n > _MAX[opt]:
            shown = value if len(value) <= 30 else f"{value[:20]}... ({len(value)} digits)"
            raise PromptLineError(line, f"option --{opt} must be at most {_MAX[opt]}, got {shown}", opt)
        return n
    try:
        x = float(value)
    except ValueError:
        raise PromptLineError(line, f"option --{opt} expects a number, got {value!r}", opt) from None
    if not math.isfinite(x) or x < 0:
        raise PromptLineError(line, f"option --{opt} must be a finite number >= 0, got {value!r}", opt)
    return x


def parse_prompt_line(text: str, line: int) -> SamplePrompt | None:
    """Parse one line; None for blank/comment lines; PromptLineError if malformed."""
    text = text.strip()
    if not text or text.startswith("#"):
        return None
    if "\x00" in text:
        raise PromptLineError(line, "contains a NUL character (a binary or UTF-16 file? save it as UTF-8 text)")
    # Leading space so a line that starts with "--w 64" yields an empty prompt, not prompt "--w 64".
    prompt, *parts = (" " + text).split(" --")
    prompt = prompt.strip()
    if not prompt:
        raise PromptLineError(line, "empty prompt text (the prompt must come before the first --option)")
    fields: dict[str, object] = {}
    for part in parts:
        m = _OPTION_RE.match(part.strip())
        if not m:
            raise PromptLineError(line, f"malformed option '--{part.strip()}'", part.strip())
        opt, value = m.group(1).lower(), (m.group(2) or "").strip()
        if opt not in _OPTIONS:
            known = ", ".join(f"--{k}" for k in _OPTIONS)
            raise PromptLineError(line, f"unknown option --{m.group(1)} (known: {known})", opt)
        name, kind = _OPTIONS[opt]
        if kind == "path":  # --i repeats: one per control image
            fields[name] = (*fields.get(name, ()), _convert(value, kind, opt, line))
            continue
        if name in fields:  # a repeated option is almost always a typo; don't guess which wins
            raise PromptLineError(line, f"option --{opt} given more than once", opt)
        fields[name] = _convert(value, kind, opt, line)
    return SamplePrompt(line=line, prompt=prompt, **fields)


def read_prompts(path) -> tuple[list[SamplePrompt], list[str]]:
    """Parse a prompts file; bad lines are skipped and reported as 'path:line: reason'."""
    path = Path(path)
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"sample.prompts_file={str(path)!r} {what}")
    # Decode line by line so one bad byte costs one line, not the whole file.
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    elif raw.startswith((b"\xff\xfe", b"\xfe\xff")):  # UTF-16 (Windows "Unicode"): as UTF-8 every line is NUL-riddled
        try:
            raw = raw.decode("utf-16").encode("utf-8")
        except UnicodeDecodeError as e:
            return [], [f"{path}: starts with a UTF-16 byte-order mark but is not valid UTF-16 (byte {e.start}); "
                        f"no prompts read; save it as UTF-8"]
    prompts: list[SamplePrompt] = []
    warnings: list[str] = []
    for n, chunk in enumerate(raw.splitlines(), start=1):
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            warnings.append(f"{path}:{n}: not valid UTF-8 (byte {e.start}); line skipped")
            continue
        try:
            p = parse_prompt_line(text, n)
        except PromptLineError as e:
            warnings.append(f"{path}:{n}: {e.reason}; line skipped")
            continue
        if p is not None:
            prompts.append(p)
    return prompts, warnings


def sample_settings(cfg: Config, plan: Plan, prompt: dict) -> dict:
    """A prompt's own kohya options win over the sample.* defaults."""
    sc = cfg.sample
    # a video family's plan names its sample length and rate (tasks/data/video.py); image families' keys stay
    video = {"frames": prompt.get("frames") or plan.video["frames"], "fps": plan.video["fps"]} \
        if plan.video else {}
    return {**video, "width": prompt["width"] or sc.width or plan.size[0],
            "height": prompt["height"] or sc.height or plan.size[1],
            "steps": prompt["steps"] or sc.steps,
            "guidance": prompt["guidance"] if prompt["guidance"] is not None else sc.cfg,
            "true_cfg": prompt["true_cfg"] if prompt["true_cfg"] is not None else sc.true_cfg,
            "seed": prompt["seed"] if prompt["seed"] is not None else sc.seed,
            "generator_device": sc.generator_device}
