"""Node cache_latents: one VAE-encoded latent per image, keyed by image bytes, VAE identity and preprocessing."""
from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path

from tasks.config import Config, ConfigError
from tasks.data import clips, controls, masks, vae_tiling, video
from tasks.data.images import image_to_tensor_and_geometry, read_image
from tasks.items import BackgroundWrites, check_items, chunks, load_once, node_result, prefetch, progress
from tasks.lazy import lazy
from tasks.models import adapter_class, make_adapter
from tasks.plan import Plan
from tasks.runtime import cuda_available, runtime
from tasks.store import Store
from tasks.store.hashing import key_of


torch = lazy("torch")
Image, ImageOps = lazy("PIL.Image"), lazy("PIL.ImageOps")  # a no-op run decodes no image

CODE_VERSION = "1"
KIND = "latents"
log = logging.getLogger("loraflow")


def params(cfg: Config, plan: Plan) -> dict:
    """Everything besides the image bytes that determines a latent."""
    version = adapter_class(plan.family).latent_version  # the family's own, once set (SDXL: size ids stored)
    settings = make_adapter(cfg.model, plan.model_dir).latent_settings()  # e.g. the VAE's compute dtype
    return {"node": "cache_latents", "code": CODE_VERSION, "vae": plan.ids["vae"], "size": plan.size,
            "resize": "cover+center-crop+bicubic", "dtype": cfg.model.dtype, "family": plan.family,
            **({"family_version": version} if version else {}), **settings, **runtime()}


def _item_key(p: dict, plan: Plan, it: dict, image_digest: str, tiling: dict | None = None) -> str:
    # A bucketed item carries its own size; the key has the size it is encoded at either way. A flipped
    # twin (data.flip_aug) is the same bytes mirrored: "flip" in its key only, so other keys stay.
    size = encode_size(plan, it) if tiling else None
    tiled = {"vae_tiling": tiling[size]} if size in (tiling or {}) else {}  # named only where it tiled
    flip = {"flip": "horizontal"} if "flip_of" in it else {}
    resize = {"resize_to": it["resize_to"]} if "resize_to" in it else {}  # a control at its family's size
    clip = {"clip": it["clip"]} if "clip" in it else {}  # a video clip: the frames taken and their rate
    cond = {"condition": it["condition"]} if "condition" in it else {}  # image-to-video: where from, for how long
    return key_of({**p, "size": it.get("size", plan.size), "image": image_digest, **flip, **resize, **clip, **cond,
                   **tiled})


MASK = masks.PREFIX  # an item's loss mask (data.mask_dir / alpha_mask), stored in this node's kind


def _mask_key(plan: Plan, it: dict) -> str:
    # the mask's bytes and the geometry only: a VAE or dtype change leaves masks as they are (tasks/data/masks.py)
    flip = {"flip": "horizontal"} if "flip_of" in it else {}
    return key_of({"node": "cache_latents", "code": CODE_VERSION, "mask": it["mask_kind"], "digest": it["mask_digest"],
                   "size": it.get("size", plan.size), "resize": "cover+center-crop+bicubic", **flip})


def latent_items(plan: Plan) -> list[dict]:
    """What is encoded: each image, and each control image of an edit pair (data.control_dirs) as an item
    `control:<image>:<k>` fitted to its target's size, mirrored with it, then resized to the family's control
    size where its pipeline resizes controls (`resize_to`; tasks/data/controls.py)."""
    out = list(plan.items)
    control_size = adapter_class(plan.family).control_size
    for it in plan.items:
        size, to = list(it.get("size", plan.size)), list(control_size(*it.get("size", plan.size)))
        resize = {"resize_to": to} if to != size else {}
        # image-to-video (tasks/data/first_frame.py): the condition of a clip this long, from its first frame
        # (at the clip's rate) or from the image beside it
        cond = {"condition": {**it["i2v"], **it["clip"]}} if "i2v" in it else {}
        for k, (path, digest) in enumerate(it.get("controls", [])):
            out.append({"name": controls.item_name(it["name"], k), "image": path, "image_digest": digest,
                        **{f: it[f] for f in ("size", "flip_of") if f in it}, **resize, **cond})
    return out


def encode_size(plan: Plan, it: dict) -> str:
    """The size an item is encoded at, as tiling is decided and reported: "64x48", a clip's "64x48x17"."""
    w, h = it.get("resize_to", it.get("size", plan.size))
    frames = it["clip"]["frames"] if "clip" in it else it["condition"]["frames"] if "condition" in it else 1
    return f"{w}x{h}" + (f"x{frames}" if frames > 1 else "")


@functools.cache
def _card_gb() -> tuple[float, str]:
    """The device's whole memory: CUDA's, else the host's RAM. Its size, not what is free now: a latent's key
    follows the decision, and the keys are made again by every process of a run (the flow, its shard workers,
    flows.explain), so a decision that moved with free memory would re-encode (and retrain) on a no-op."""
    if cuda_available():
        total = torch.cuda.mem_get_info()[1]
        return total / vae_tiling.GB, f"the memory of {torch.cuda.get_device_name()}"
    meminfo = Path("/proc/meminfo")
    m = re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text()) if meminfo.exists() else None
    return (int(m.group(1)) * 1024 / vae_tiling.GB, "the host's RAM") if m else (float("inf"), "no known limit")


def tiling_plan(cfg: Config, plan: Plan, p: dict | None = None) -> dict[str, dict]:
    """Per encode size: {"tiled": bool, "key": what a tiled latent's key says (the adapter's tiling settings, or
    true)} and, for data.vae_tiling=auto, the untiled encode's estimate and the budget it was held to (GiB):
    train.memory_limit_gb, else the device's memory. Decided once per size for every item of it."""
    settings = adapter_class(plan.family).vae_tiling
    sizes = {encode_size(plan, it): it for it in latent_items(plan)}
    out = {s: {"tiled": cfg.data.vae_tiling == "tiled", "key": dict(settings) or True} for s in sizes}
    if cfg.data.vae_tiling != "auto" or not sizes:
        return out
    path = Path(plan.model_dir) / "vae" / "config.json"
    config = {**(json.loads(path.read_text()) if path.is_file() else {}), **settings}
    dtype = (p or params(cfg, plan)).get("vae_dtype", cfg.model.dtype)  # an upcast VAE computes in float32
    budget, source = (cfg.train.memory_limit_gb, "train.memory_limit_gb") if cfg.train.memory_limit_gb else _card_gb()
    for s, it in sizes.items():
        w, h = it.get("resize_to", it.get("size", plan.size))
        frames = int(s.split("x")[2]) if s.count("x") == 2 else 1
        need = vae_tiling.encode_peak_gb(config, w, h, frames, dtype, tiled=False)
        out[s].update(tiled=need > budget, untiled_gb=round(need, 2), budget_gb=round(budget, 2), budget=source)
    return out


def _tiling_keys(tiling: dict[str, dict]) -> dict:
    """{size: its key's tiling} for the tiled sizes only: untiled latents keep the keys they always had."""
    return {s: t["key"] for s, t in tiling.items() if t["tiled"]}


def item_keys(cfg: Config, plan: Plan) -> dict[str, str]:
    """{item name: its latent's key} (control images too), and {"mask:<name>": its mask's key} for the items
    with a loss mask."""
    p = params(cfg, plan)
    tiling = _tiling_keys(tiling_plan(cfg, plan, p))
    return {**{it["name"]: _item_key(p, plan, it, it["image_digest"], tiling) for it in latent_items(plan)},
            **{MASK + it["name"]: _mask_key(plan, it) for it in plan.items if "mask" in it}}


def inputs(cfg: Config, plan: Plan) -> dict:
    items, p = latent_items(plan), params(cfg, plan)
    tiling = _tiling_keys(tiling_plan(cfg, plan, p))
    return {**p, **({"vae_tiling": tiling} if tiling else {}),
            **{f"image:{it['name']}": it["image_digest"] for it in items},
            **{f"size:{it['name']}": it["size"] for it in items if "size" in it},
            **{f"flip:{it['name']}": "horizontal" for it in items if "flip_of" in it},
            **{f"clip:{it['name']}": it["clip"] for it in items if "clip" in it},
            **{f"condition:{it['name']}": it["condition"] for it in items if "condition" in it},
            **{MASK + it["name"]: [it["mask_kind"], it["mask_digest"]] for it in plan.items if "mask" in it}}


def _write_masks(store: Store, plan: Plan, todo: list[dict], keys: dict[str, str]) -> None:
    """Each item's mask through its image's resize and crop (tasks/data/masks.py), uint8, one entry each."""
    for it in todo:
        img = masks.mask_image(it["mask"], it["mask_kind"])
        pixels = masks.mask_pixels(img, *it.get("size", plan.size), flip="flip_of" in it)
        store.put_tensors(KIND, keys[MASK + it["name"]], {"mask": pixels}, meta={"mask": it["name"]}, recomputable=True)


# Batch size 1 by default: an item's bytes must not depend on which other items shared its batch
# (CPU kernels are not batch-invariant), so a resumed or partial run yields the same bytes.
def _pixels(batch: list[dict], size) -> tuple[torch.Tensor, list[dict], list[str]]:
    """Pixels of a batch; per item its original size and crop offsets (what the latent means) and the
    digest of the bytes decoded. A clip's frames go through the image path one by one: [3, F, H, W]."""
    if "clip" in batch[0]:
        return _clip_pixels(batch, size)
    if "condition" in batch[0]:
        return _condition_pixels(batch, size)
    read = [read_image(it["image"]) for it in batch]
    # a flipped twin is mirrored before the resize and crop: its geometry is that of the image it trains on
    read = [(ImageOps.mirror(img) if "flip_of" in it else img, d) for (img, d), it in zip(read, batch)]
    read = [(controls.resized(img, it.get("size", size), it["resize_to"]) if "resize_to" in it else img, d)
            for (img, d), it in zip(read, batch)]  # fitted to its target, then at its family's control size
    done = [image_to_tensor_and_geometry(img, *it.get("resize_to", it.get("size", size)))
            for (img, _), it in zip(read, batch)]
    pixels = torch.stack([p for p, _ in done])
    pixels = pixels.pin_memory() if torch.cuda.is_available() else pixels  # pinned: an async copy to the GPU
    return pixels, [g for _, g in done], [d for _, d in read]


def _clip_pixels(batch: list[dict], size) -> tuple[torch.Tensor, list[dict], list[str]]:
    out, digests = [], []
    for it in batch:
        frames, digest = clips.read_clip(it["image"], it["clip"]["frames"], it["clip"]["fps"])
        if len(frames) != it["clip"]["frames"]:
            raise ConfigError(f"cache_latents: {it['name']}: {len(frames)} frame(s) decoded where validate counted "
                              f"{it['clip']['frames']} (a variable-rate clip?); re-encode it at a constant rate")
        images = [Image.fromarray(f) for f in frames]
        images = [ImageOps.mirror(img) if "flip_of" in it else img for img in images]
        out.append(torch.stack([image_to_tensor_and_geometry(img, *it.get("size", size))[0] for img in images], dim=1))
        digests.append(digest)
    return torch.stack(out), [{} for _ in batch], digests


def _condition_pixels(batch: list[dict], size) -> tuple[torch.Tensor, list[dict], list[str]]:
    """Each clip's condition image fitted as its clip's frames are (a first frame, or the image beside it):
    pixels [B, 3, H, W], and per item {"image": the fitted PIL image} (what a sampler is given, for encoders
    with their own preprocessing: Wan 2.1's CLIP)."""
    out, geometry, digests = [], [], []
    for it in batch:
        if it["condition"]["from"] == "first_frame":
            frames, digest = clips.read_clip(it["image"], 1, it["condition"]["fps"])
            img = Image.fromarray(frames[0])
        else:
            img, digest = read_image(it["image"])
        img = ImageOps.mirror(img) if "flip_of" in it else img
        pixels, _ = image_to_tensor_and_geometry(img, *it.get("size", size))
        out.append(pixels)
        geometry.append({"image": controls.fitted_image(img, *it.get("size", size))})
        digests.append(digest)
    return torch.stack(out), geometry, digests


def batches_of(todo: list[dict], batch_size: int) -> list[list[dict]]:
    """Batches of one shape: items by (size, frames) in first-seen order, then chunked (a batch of clips of
    different lengths, or of a clip and an image, cannot stack)."""
    groups: dict = {}
    for it in todo:
        groups.setdefault((tuple(it.get("size", ())), "clip" in it, video.frames_of(it),
                           str(it.get("condition"))), []).append(it)
    return [b for group in groups.values() for b in chunks(group, batch_size)]


def run(cfg: Config, plan: Plan, store: Store, batch_size: int = 1, only: set[str] | None = None,
        models: dict | None = None) -> dict:
    """`only`: compute just these item keys (a shard of the node's missing items, flows/shards.py);
    `models`: a worker process's memo of loaded models (tasks/items.py: load_once)."""
    keys, tiling = item_keys(cfg, plan), tiling_plan(cfg, plan)
    status = check_items(store, KIND, [k for k in keys.values() if only is None or k in only])
    missing = set(status.missing)  # once: per item it made the node quadratic (minutes at 100,000)
    mask_todo = [it for it in plan.items if MASK + it["name"] in keys and keys[MASK + it["name"]] in missing]
    if mask_todo:  # no VAE: a mask edit computes that mask alone
        distinct = list({keys[MASK + it["name"]]: it for it in mask_todo}.values())  # identical masks: one entry
        _write_masks(store, plan, distinct, keys)
        log.info("cache_latents: made %d loss mask(s)", len(distinct))
    if missing - {keys[MASK + it["name"]] for it in mask_todo}:
        todo = [it for it in latent_items(plan) if keys[it["name"]] in missing]
        todo = list({keys[it["name"]]: it for it in todo}.values())  # identical images are encoded once
        adapter = make_adapter(cfg.model, plan.model_dir)
        vae = load_once(models, (KIND, key_of(plan.ids), cfg.model.dtype), adapter.load_vae)
        tiled = lambda it: tiling[encode_size(plan, it)]["tiled"]  # noqa: E731
        log.info("cache_latents: VAE tiling (data.vae_tiling=%s): %s", cfg.data.vae_tiling, _describe(tiling))
        # a batch's items share one tiling (the VAE is switched per batch)
        batches = [b for batch in batches_of(todo, batch_size) for b in ([i for i in batch if not tiled(i)],
                                                                        [i for i in batch if tiled(i)]) if b]
        pixels_of = lambda batch: _pixels(batch, plan.size)  # noqa: E731
        # With CUDA the next batch is decoded while the GPU encodes this one; on the CPU a decode thread would
        # only take cores from the VAE (measured: 0.87x of a bare loop with it on 2 cores).
        loaded = prefetch(pixels_of, batches) if torch.cuda.is_available() else map(pixels_of, batches)
        not_finite, edited, p = [], [], params(cfg, plan)
        with BackgroundWrites() as writes:  # an item is written while the next one is encoded
            for batch, (pixels, geometry, digests) in progress(zip(batches, loaded), "cache_latents", len(batches)):
                vae_tiling.apply(vae, tiled(batch[0]), adapter.vae_tiling)
                if "condition" in batch[0]:  # image-to-video: the clip's condition (tasks/data/first_frame.py)
                    encoder = load_once(models, (KIND, "condition", key_of(plan.ids), cfg.model.dtype),
                                        adapter.load_condition_encoder)
                    latents = adapter.encode_condition(vae, encoder, pixels, [g.pop("image") for g in geometry],
                                                       batch[0]["condition"]["frames"])
                else:
                    latents = adapter.encode_latents(vae, pixels)
                for it, z, geom, digest in zip(batch, latents, geometry, digests):
                    if not all(torch.isfinite(t).all() for t in (z.values() if isinstance(z, dict) else [z])):
                        # never cached: training on it would give NaN losses
                        not_finite.append(it["name"])
                        continue
                    key = keys[it["name"]]
                    if digest != it["image_digest"]:  # edited since validate: stored under its new bytes' key
                        edited.append(it["name"])
                        key = _item_key(p, plan, it, digest, _tiling_keys(tiling))
                    extra = geom if adapter.size_conditioning else {}
                    if adapter.clips:  # the frame rate the latent was taken at (LTX-2's RoPE reads it in training)
                        extra = {"fps": torch.tensor(float(it["clip"]["fps"] if "clip" in it else adapter.clips.default_fps))}
                    tensors = z if isinstance(z, dict) else {"latents": z, **extra}
                    writes.submit(store.put_tensors, KIND, key, tensors, meta={"image": it["name"]}, recomputable=True)
        log.info("cache_latents: encoded %d image(s), reused %d", len(todo), len(status.reused))
        del vae
        if edited:
            raise ConfigError(f"cache_latents: {len(edited)} image(s) changed on disk after validate: "
                              f"{', '.join(sorted(edited))}. Their new pixels are cached under their new bytes; "
                              "run again to train on them (and leave data.dir alone while a run reads it)")
        if not_finite:
            raise ConfigError(f"cache_latents: the VAE gave non-finite latents (NaN/inf) for {len(not_finite)} "
                              f"image(s), not stored: {', '.join(sorted(not_finite))}. Encode in float32: "
                              "model.dtype=float32, or a VAE whose config has force_upcast=true")
    used = {s: True for s, t in tiling.items() if t["tiled"]}  # reported where it tiled: {"1024x1024": true}
    return node_result(key_of(inputs(cfg, plan)), keys, status, inputs(cfg, plan),
                       **({"vae_tiling": used} if used else {}))


def _describe(tiling: dict[str, dict]) -> str:
    """One log line: each size tiled or not, with auto's estimate against its budget."""
    def one(size: str, t: dict) -> str:
        why = f" (untiled ~{t['untiled_gb']} GiB vs {t['budget_gb']} GiB, {t['budget']})" if "untiled_gb" in t else ""
        return f"{size} {'tiled' if t['tiled'] else 'untiled'}{why}"
    return ", ".join(one(s, t) for s, t in tiling.items()) or "nothing to encode"


def key_of_node(cfg: Config, plan: Plan) -> str:
    return key_of(inputs(cfg, plan))
