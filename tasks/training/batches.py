"""What the train node reads each step: the cached caption tensors (Captions), the cached latents (Latents), and the
batch of a (micro-)step (BatchLoader), drawn statelessly from (seed, step) so that a continued run and every
process of a data-parallel run draw what one straight run draws."""
from __future__ import annotations

from dataclasses import dataclass

from tasks import cache_latents, cache_text
from tasks.data import augment, controls
from tasks.items import Memo
from tasks.lazy import lazy
from tasks.models.lora_variants import text_encoder_lora as te_lora
from tasks.store import Store
from tasks.store.hashing import key_int

torch = lazy("torch")


class Captions:
    """Caption tensors per item and step.

    cached: the augmentation's label for this step (`augment.choose`) picks a stored variant, or the
    stored empty prompt when the caption is dropped; fresh/live: a new draw (`augment.fresh`) encoded
    now, one caption at a time so it gives the bytes the cache would (hence the same loss). With
    train.text_encoder_lr the live path encodes with gradients through the encoders' LoRA (`trained`)."""

    def __init__(self, cfg, plan, store, adapter, text_keys):
        self.items, self.store, self.text_keys = plan.items, store, text_keys
        self.aug = cache_text.caption_aug(cfg)
        self.mode = augment.text_mode(te_lora.text_settings(cfg), self.aug)
        self.adapter, self.memo = adapter, Memo(MEMO_ITEMS)  # many variants of big T5 states: bounded
        self.encoders = adapter.load_text_encoders() if self.mode != "cached" else None
        self.trained = self.encoders if te_lora.enabled(cfg) else None  # train.text_encoder_lr (mode: live)
        self.encode = adapter.encode_text_live if self.trained is not None else adapter.encode_text

    def get(self, i: int, step: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        item = self.items[i]
        if self.mode != "cached":
            return self.encode(self.encoders, [augment.fresh(item["caption"], self.aug, step, generator)])[0]
        label = augment.choose(item["caption"], self.aug, step, generator)
        owner = cache_text.caption_owner(item)  # a flipped twin reads its source's cached texts
        if label is None:  # dropped: the empty prompt, the item's own where the encoder sees its controls
            name = f"empty:{owner}" if f"empty:{owner}" in self.text_keys else "empty"
        else:
            name = cache_text.caption_name(owner, label)
        key = self.text_keys[name]
        return self.memo.get_or_load(key, lambda: self.store.get_tensors(cache_text.KIND, key))


def item_generators(seed: int, step: int, n: int) -> list[torch.Generator]:
    """One CPU generator per batch position of a step: an item's caption variant, noise and timestep are a
    function of (seed, step, position) only, so every process of a data-parallel run draws what a
    single process draws for the same item, and a continued run draws what a straight run draws."""
    return [torch.Generator("cpu").manual_seed(key_int(seed, "item", step, j)) for j in range(n)]


def my_share(positions: int, rank: int, world: int) -> tuple[list[int], float]:
    """The batch positions this process trains on and the weight of its mean loss, so that the sum over
    processes of weight x gradient is the gradient of the whole batch's mean loss. A process left without
    an item (a batch smaller than the number of processes) runs position 0 at weight 0: every process
    must take part in the gradient exchange."""
    mine = list(range(rank, positions, world))
    return (mine, len(mine) / positions) if mine else ([0], 0.0)


def batch_at(step: int, groups: list[list[int]], batch_size: int, seed: int) -> list[int]:
    """Item indices of a 1-based step. `groups` are the aspect buckets (one group without bucketing):
    each epoch permutes every group, cuts it into batches (the last partial one kept), and shuffles the
    order of those batches across groups, all from (seed, epoch). Stateless, so a run continued from a
    checkpoint draws the batches a straight run draws."""
    per_epoch = sum(-(-len(g) // batch_size) for g in groups)
    epoch, i = divmod(step - 1, per_epoch)
    batches = []
    for g, members in enumerate(groups):
        gen = torch.Generator("cpu").manual_seed(key_int(seed, epoch) if len(groups) == 1 else key_int(seed, epoch, g))
        order = [members[j] for j in torch.randperm(len(members), generator=gen).tolist()]
        batches += [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
    if len(groups) > 1:
        mix = torch.Generator("cpu").manual_seed(key_int(seed, epoch, "order"))
        batches = [batches[j] for j in torch.randperm(len(batches), generator=mix).tolist()]
    return batches[i]


def buckets_of(shapes: list[tuple[int, ...]], repeats: list[int] | None = None) -> list[list[int]]:
    """Indices grouped by latent shape (one group when every image has the training size). An item with
    `repeats` N (data.subsets, kohya's N_name folders) is in its group N times: drawn N times per epoch."""
    groups: dict[tuple, list[int]] = {}
    for i, shape in enumerate(shapes):
        n = repeats[i] if repeats else 1
        if n:  # 0: never drawn (a held-out item, data.validation_split)
            groups.setdefault(tuple(shape), []).extend([i] * n)
    return [groups[k] for k in sorted(groups)]


def loss_weights(items: list[dict], prior_loss_weight: float) -> list[float]:
    """Per item: train.prior_loss_weight for a regularisation image (is_reg), 1 otherwise (kohya's loss_weights)."""
    return [float(prior_loss_weight) if it.get("is_reg") else 1.0 for it in items]


MEMO_ITEMS = 4096  # per kind; about 4 GiB of 1024px Flux latents. Beyond it, items are read again as needed


class Latents:
    """Cached latents by item index, read from the store when a batch needs them (in the loader thread
    with CUDA) and kept in a bounded memo: a dataset that does not fit in RAM trains too. The shapes (for
    the buckets) come from the entries' headers."""

    def __init__(self, store: Store, keys: list[str]):
        self.store, self.keys, self.memo = store, keys, Memo(MEMO_ITEMS)
        self.shapes = [tuple(self._shape(i)) for i in range(len(keys))]

    def _shape(self, i: int):
        # Up to the memo's size, the latent itself is loaded (and verified) once, here; beyond it, its header.
        if len(self.memo) < self.memo.size:
            return self[i]["latents"].shape
        return self.store.tensor_shapes(cache_latents.KIND, self.keys[i])["latents"]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """"latents", and for SDXL the image's "original_size" and "crop_top_left" (its size conditioning)."""
        return self.memo.get_or_load(i, lambda: self.store.get_tensors(cache_latents.KIND, self.keys[i]))


def stack(dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([d[k] for d in dicts]) for k in dicts[0]}


@dataclass
class Batch:
    """One step's share of this process, on the CPU: its loss weight, one generator per item (the caption
    choice already drawn from them; noise and timestep are drawn next), latents and text tensors."""
    weight: float
    generators: list[torch.Generator]
    latents: torch.Tensor
    text: dict[str, torch.Tensor]
    item_weights: list[float] | None = None  # per-item loss weights (reg images); None: all 1
    loss_mask: torch.Tensor | None = None  # uint8 [B, 1, H, W] pixel masks (data.mask_dir / alpha_mask)


def pinned(t: torch.Tensor) -> torch.Tensor:
    """Page-locked with CUDA, so the copy to the GPU is asynchronous; else (or a trained encoder's output) as is."""
    return t.pin_memory() if torch.cuda.is_available() and t.device.type == "cpu" and not t.requires_grad else t


class BatchLoader:
    """Micro-batch m -> this process's Batch: with CUDA called one micro-batch ahead, in a thread (prefetch).
    Micro-batch m of optimizer step s is number (s-1)*accum + m: batches and draws are those of a run without
    accumulation at that number; captions follow the optimizer step (token warm-up)."""

    def __init__(self, store: Store, items: list[dict], latent_keys: dict, latents: Latents, texts: Captions,
                 groups: list[list[int]], batch_size: int, seed: int, rank: int, world: int, accum: int,
                 prior_loss_weight: float):
        from tasks.data import masks

        self.store, self.latents, self.texts, self.groups = store, latents, texts, groups
        self.batch_size, self.seed, self.rank, self.world, self.accum = batch_size, seed, rank, world, accum
        self.mask_keys = [latent_keys.get(masks.PREFIX + it["name"]) for it in items]  # masked loss: tasks/data/masks.py
        self.control_keys = self.control_keys_of(items, latent_keys)
        self.weights = loss_weights(items, prior_loss_weight)

    @staticmethod
    def control_keys_of(items: list[dict], latent_keys: dict) -> list[list[str]]:
        """Edit pairs: each item's control latents (tasks/data/controls.py); [] for an item without."""
        return [[latent_keys[controls.item_name(it["name"], k)] for k in range(len(it.get("controls", [])))]
                for it in items]

    def __call__(self, micro: int) -> Batch:
        idx = batch_at(micro, self.groups, self.batch_size, self.seed)
        mine, weight = my_share(len(idx), self.rank, self.world)
        gens = item_generators(self.seed, micro, len(idx))
        gens = [gens[j] for j in mine]
        step = (micro - 1) // self.accum + 1
        text = stack([self.texts.get(idx[j], step, g) for j, g in zip(mine, gens)])
        stored = [self.latents[idx[j]] for j in mine]  # the size conditioning stored with a latent joins the text
        text.update(stack([{k: v for k, v in d.items() if k != "latents"} for d in stored]))
        if self.control_keys[idx[0]]:  # [B, K, C, h, w]: the adapter packs them beside the noisy latents
            text.update(controls.stacked([[self.store.get_tensors(cache_latents.KIND, k) for k in self.control_keys[idx[j]]]
                                          for j in mine]))
        item_weights = [self.weights[idx[j]] for j in mine]
        mask = (torch.stack([self.store.get_tensors(cache_latents.KIND, self.mask_keys[idx[j]])["mask"] for j in mine])
                if self.mask_keys[idx[0]] else None)
        return Batch(weight, gens, pinned(torch.stack([d["latents"] for d in stored])),
                     {k: pinned(v) for k, v in text.items()}, None if set(item_weights) == {1.0} else item_weights,
                     mask)
