"""The plan validate makes and every later node reads: its schema, in one place.

validate.run returns a `Plan`; the flow stores `plan.stored()` (JSON, keyed by its content: the nodes get that
key, not 100,000 items through Prefect) and a node reads it back with `Plan.from_stored`. The stored form is the
dict the plan was before it was typed, key for key, so plan keys stored by earlier runs stay valid.

The items stay dicts (they are per-item JSON, read by key in the hot loops of the caching nodes); `PlanItem` names
their keys for a type checker."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TypedDict


class Clip(TypedDict):
    frames: int  # the frames its latent is encoded from (1 + frame_step x k)
    fps: float  # the rate they are taken at


class PlanItem(TypedDict, total=False):
    """One item of the plan: an image (or clip) the nodes cache and train on."""
    name: str  # its name in the dataset (a subset's prefix included): the key of its latent and captions
    image: str  # the file
    image_digest: str
    caption: str
    repeats: int  # a subset's num_repeats, where not 1
    is_reg: bool  # a regularisation image (a subset with is_reg), where true
    clip: Clip  # a video family's clip
    mask: str  # the loss mask's file (data.mask_dir) or the image itself (data.alpha_mask)
    mask_kind: str  # "file" or "alpha"
    mask_digest: str
    controls: list  # [file, digest] of each control image (data.control_dirs)
    size: list  # its bucket [width, height] (data.buckets)
    flip_of: str  # the mirror image of this item (data.flip_aug)


class ModelIds(TypedDict):
    """The identity of each group of the model's components, as the nodes' keys name them."""
    vae: str
    text: str
    denoiser: str
    sample: str
    scheduler: str


@dataclass
class Plan:
    family: str
    model_dir: str  # the model's diffusers folder (a converted single file's in the store)
    ids: ModelIds
    size: list  # [width, height]: the training size (buckets are around its area)
    items: list[PlanItem]
    prompts: list[dict]  # the sample prompts (tasks/data/prompts.py: planned_prompts)
    warnings: list[str]
    augmentation: dict  # {mode, active, description} of the caption augmentation
    dataset: list[dict]  # the findings on files left out or shared ({file, reason, policy})
    dataset_subsets: list[dict]
    # items held out for the validation loss (data.validation_split): cached, never trained
    validation_items: list[str] = field(default_factory=list)
    video: dict | None = None  # a video family's sample length and rate: {frames, fps}
    # the memory estimate: for the report only, never stored (it reads free RAM now)
    memory: dict | None = None

    def stored(self) -> dict:
        """The JSON the store keeps: every field but `memory`, the optional ones only where set."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _OPTIONAL}
        out.update({k: getattr(self, k) for k in ("validation_items", "video") if getattr(self, k)})
        return out

    @classmethod
    def from_stored(cls, data: dict) -> Plan:
        return cls(**data)


_OPTIONAL = ("validation_items", "video", "memory")
