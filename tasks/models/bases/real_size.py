"""What a family declares for the benchmarks about its full-size models (issue 64 item 4: a family lives in its own
files): bench.memory's train rows, node rows and card table read these from the registry (bench/family_models.py),
not from tables of family names. Plain data: no torch, no diffusers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RealSize:
    """One full-size model of the family, as bench.memory builds it on the meta device (random weights at its
    released config): `name` is its row prefix (`<name>:<options>`, `<name>:<node>:<options>`).

    denoiser: the diffusers class; arch: its config values where they differ from the class defaults (the released
    config.json's). size: the (width, height) it trains at, None: the rows' square resolution; frames: a clip's.
    text: (pipeline component, encoder) pairs, an encoder a name of bench/text_encoder_configs.py or its own
    (transformers config class, model class, config.json values). vae: (diffusers class, config values).
    rows: the options of its train rows (`bf16+ckpt`, `nf4+ckpt+offload+swap8`, ...; bench/memory_families.py).
    card: (smallest card GB, host RAM GB) the whole run is meant to fit, for the card table; None: not in it."""
    name: str
    denoiser: str
    arch: dict = field(default_factory=dict)
    size: tuple[int, int] | None = None
    frames: int = 1
    text: tuple = ()
    vae: tuple = ()
    rows: tuple[str, ...] = ()
    card: tuple[int, int] | None = None
