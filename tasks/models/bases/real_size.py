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
    card: (card GB, host RAM GB) the whole run is meant to fit (bench.memory's goals): its node rows and a card-table
    row; cards: card-table rows without such a goal, as the denoiser copies trained (1; Wan 2.2 A14B's
    model.expert=both: 2, the row `<name>_both`); train_goal_gib: the GiB some train row is meant to fit.
    image_encoders: (component, encoder) as `text`, but encoded with the latents (Wan 2.1 I2V's CLIP);
    modules: (component, "module:Class") other diffusers modules of the folder at their class defaults (LTX-2's text
    connectors); denoisers: the denoiser folders the sample node loads, each the same shapes (Wan 2.2 A14B: both
    experts; Ideogram 4: the conditional and the unconditional transformer)."""
    name: str
    denoiser: str
    arch: dict = field(default_factory=dict)
    size: tuple[int, int] | None = None
    frames: int = 1
    text: tuple = ()
    vae: tuple = ()
    rows: tuple[str, ...] = ()
    card: tuple[int, int] | None = None
    cards: tuple[int, ...] = ()
    train_goal_gib: float | None = None
    image_encoders: tuple = ()
    modules: tuple = ()
    denoisers: tuple[str, ...] = ("transformer",)

    def card_rows(self) -> tuple:
        """(card-table key, model, denoiser copies) of each of its card-table rows."""
        copies = self.cards or ((1,) if self.card else ())
        return tuple((self.name if n == 1 else f"{self.name}_both", self.name, n) for n in copies)
