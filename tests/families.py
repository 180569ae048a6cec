"""A family's tiny model on 4 demo images at 32 px (tag captions, a prompts file, its own store), run at the
node functions as the flow runs them: what tests/test_new_families.py and tests/test_multiprocess.py share."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

from tasks import cache_latents, cache_text, sample, train, validate
from tasks.config import compose, resolve_paths
from tasks.models import FAMILIES, adapter_class
from tasks.store import Store

REPO = Path(__file__).resolve().parents[1]
# the 2026 families (the first wave, then issue 64's)
NEW = ["zimage", "qwenimage", "flux2_klein", "flux2_dev", "krea2", "ideogram4", "qwenimage21", "chroma", "ernie_image",
       "hidream", "lumina2"]


def image_families() -> list[str]:
    """The registry's text-to-image families (tasks/models/__init__.py FAMILIES, by what each declares): those
    that render from a prompt alone, the video families left out."""
    return [f for f in FAMILIES if adapter_class(f).clips is None and not adapter_class(f).controls.required]
N = 4  # images
PROMPTS = "a red circle on a blue background\na green square --n blurry\na blue triangle --w 48 --h 32\n"


class Family:
    """4 demo images with tag captions, a prompts file and a store; runs the node functions on them."""

    def __init__(self, family: str, root: Path):
        self.family, self.root, self.data, self.store = family, root, root / "data", root / "store"
        self.data.mkdir(parents=True)
        for i in range(N):
            shutil.copy(REPO / "data" / "demo" / f"img_{i:02d}.png", self.data)
            caption = (REPO / "data" / "demo" / f"img_{i:02d}.txt").read_text().strip().replace(" on ", ", ")
            (self.data / f"img_{i:02d}.txt").write_text(caption + ", flat colors, toy\n")
        (root / "prompts.txt").write_text(PROMPTS)
        self.base = [f"model=tiny_{family}", f"sample.prompts_file={root / 'prompts.txt'}", f"store.root={self.store}",
                     "data.resolution=32", "train.max_steps=3", "train.batch_size=2", "train.log_every=1",
                     "sample.steps=2"]

    def cfg(self, *extra, data: Path | None = None) -> dict:
        return resolve_paths(compose("train", [*self.base, f"data.dir={data or self.data}", *extra])[0])

    def keys(self, *extra, data: Path | None = None):
        """(latent keys, text keys, LoRA key, sample keys) of a run with these overrides."""
        cfg = self.cfg(*extra, data=data)
        plan = validate.run(cfg, Store(self.store))
        lat, txt = cache_latents.item_keys(cfg, plan), cache_text.item_keys(cfg, plan)
        lora = train.key_of_node(cfg, plan, lat, txt)
        return lat, txt, lora, sample.item_keys(cfg, plan, lora, txt)

    def train(self, *extra) -> tuple[dict, dict]:
        """(cache_text's result, train's result), every node before train run as the flow runs them."""
        cfg, store = self.cfg(*extra), Store(self.store)
        plan = validate.run(cfg, store)
        lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
        return txt, train.run(cfg, plan, store, lat["items"], txt["items"])

    def loss_terms(self, result: dict, batch: int) -> int:
        """Terms in one step's mean loss: `batch` latents of this run's shape (all demo images share it)."""
        cfg = self.cfg()
        plan = validate.run(cfg, Store(self.store))
        key = cache_latents.item_keys(cfg, plan)[plan.items[0]["name"]]
        return batch * math.prod(Store(self.store).tensor_shapes(cache_latents.KIND, key)["latents"])
