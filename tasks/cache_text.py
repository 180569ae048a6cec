"""Node cache_text: every distinct text (captions, sample prompts and negatives, the empty prompt) encoded once;
for Qwen-Image-Edit, whose text encoder sees the control images, each text with its images (named_images)."""
from __future__ import annotations

import logging

from tasks.config import Config
from tasks.data import augment, controls, prompts
from tasks.items import BackgroundWrites, check_items, chunks, load_once, node_result, progress
from tasks.models import adapter_class, make_adapter
from tasks.models.lora_variants import text_encoder_lora as te_lora
from tasks.plan import Plan
from tasks.runtime import runtime
from tasks.store import Store
from tasks.store.hashing import digest_text, key_of


CODE_VERSION = "1"
KIND = "text"
log = logging.getLogger("loraflow")


def params(cfg: Config, plan: Plan) -> dict:
    # text.quantize names how the encoders were stored (an nf4 encoder's embeddings never stand in for bf16 ones);
    # absent at none, so keys made before it stay; text.offload moves weights, never changes a value: not in it
    stored = {"text_quantize": cfg.text.quantize} if cfg.text.quantize != "none" else {}
    return {"node": "cache_text", "code": CODE_VERSION, "encoders": plan.ids["text"],
            "max_sequence_length": cfg.model.max_sequence_length, "dtype": cfg.model.dtype,
            "family": plan.family, **stored, **runtime()}


def caption_aug(cfg: Config) -> augment.CaptionAug:
    return augment.from_config(cfg.data, cfg.text, cfg.train.max_steps)


def caption_name(item: str, label: str) -> str:
    """`caption:<item>` for the caption as written, `caption:<item>:<label>` for an augmentation variant."""
    return f"caption:{item}" if label == "full.v0" else f"caption:{item}:{label}"


def caption_owner(item: dict) -> str:
    """The item whose cached caption texts this item trains with: a flipped twin reads its source's."""
    return item.get("flip_of", item["name"])


def caption_texts_of(cfg: Config):
    """item -> caption_texts of that item, with the augmentation settings read once (100,000 items)."""
    aug = caption_aug(cfg)
    if augment.text_mode(te_lora.text_settings(cfg), aug) != "cached":
        return lambda item: {}
    seed = cfg.text.variants_seed
    return lambda item: augment.cached_texts(item["caption"], aug, seed)


def caption_texts(cfg: Config, plan: Plan, item: dict) -> dict[str, str]:
    """label -> text of every caption text training reads from the cache for this item (with augmentation:
    each variant and warm-up truncation); empty when training encodes captions itself."""
    return caption_texts_of(cfg)(item)


def named_texts_only(plan: Plan, cfg: Config) -> dict[str, str]:
    """Every text the run caches, by a readable name (for `changed` in the report). Captions (and their
    augmentation variants) only when training reads them from the cache; otherwise it encodes them. None
    with train.text_encoder_lr: train and sample encode every text with the encoders being trained."""
    if te_lora.enabled(cfg):
        return {}
    texts_of = caption_texts_of(cfg)
    texts = {caption_name(it["name"], label): text for it in plan.items if "flip_of" not in it
             for label, text in texts_of(it).items()}  # a flipped twin has its source's texts
    for p in plan.prompts:
        texts[f"prompt:{p['line']}"] = p["prompt"]
        if p["negative"]:
            texts[f"negative:{p['line']}"] = p["negative"]
    texts["empty"] = ""  # the unconditional prompt (caption dropout, CFG)
    return texts


def named_images(plan: Plan, cfg: Config) -> dict[str, dict]:
    """For a family whose text encoder sees the control images (Qwen-Image-Edit), what each text is encoded
    with: {name: {"images": [[file, sha256], ...], "size": [w, h]}}, the controls fitted to that size. A
    caption (and its variants) sees its item's controls, with caption dropout so does the item's own empty
    prompt (`empty:<item>`); a sample prompt's texts see its --i images at the sample's size, and so does its
    empty prompt (`empty:prompt:<line>`, its negative for true CFG). {} for every other family."""
    if not adapter_class(plan.family).controls.seen_by_text or te_lora.enabled(cfg):
        return {}
    texts_of, out = caption_texts_of(cfg), {}
    dropout = caption_aug(cfg).caption_dropout_rate > 0
    for it in (it for it in plan.items if it.get("controls")):
        seen = {"images": it["controls"], "size": list(it.get("size", plan.size))}
        out.update({caption_name(it["name"], label): seen for label in texts_of(it)})
        if dropout:
            out[f"empty:{it['name']}"] = seen
    for p in (p for p in plan.prompts if p.get("images")):
        s = prompts.sample_settings(cfg, plan, p)
        seen = {"images": p["images"], "size": [s["width"], s["height"]]}
        out[f"prompt:{p['line']}"] = out[f"empty:prompt:{p['line']}"] = seen
        if p["negative"]:
            out[f"negative:{p['line']}"] = seen
    return out


def named_texts(plan: Plan, cfg: Config) -> dict[str, str]:
    """named_texts_only, plus the empty prompts that see control images (named_images)."""
    texts = named_texts_only(plan, cfg)
    return {**texts, **{n: "" for n in named_images(plan, cfg) if n.startswith("empty:")}}


def seen_part(seen: dict | None) -> dict:
    """What a text's key holds of the images its encoder sees: their bytes and size ({} without)."""
    return {"images": [d for _, d in seen["images"]], "image_size": seen["size"]} if seen else {}


def text_key(cfg: Config, plan: Plan, text: str, seen: dict | None = None) -> str:
    return key_of({**params(cfg, plan), "text": text, **seen_part(seen)})


def item_keys(cfg: Config, plan: Plan) -> dict[str, str]:
    p, seen = params(cfg, plan), named_images(plan, cfg)
    return {name: key_of({**p, "text": text, **seen_part(seen.get(name))}) for name, text in named_texts(plan, cfg).items()}


def inputs(cfg: Config, plan: Plan) -> dict:
    seen = named_images(plan, cfg)
    return {**params(cfg, plan), **{n: key_of([digest_text(t), seen_part(seen.get(n))]) if n in seen else digest_text(t)
                                    for n, t in named_texts(plan, cfg).items()}}


def seen_images(seen: dict | None) -> list:
    """The control images a text is encoded with, fitted to its size as they train ([] without)."""
    return [controls.fitted(f, *seen["size"]) for f, _ in seen["images"]] if seen else []


# Batch size 1: an item must not depend on its batch neighbours (see cache_latents).
def run(cfg: Config, plan: Plan, store: Store, batch_size: int = 1, only: set[str] | None = None,
        models: dict | None = None) -> dict:
    """`only`: compute just these item keys (a shard of the node's missing items, flows/shards.py);
    `models`: a worker process's memo of loaded models (tasks/items.py: load_once)."""
    texts, seen = named_texts(plan, cfg), named_images(plan, cfg)
    keys = item_keys(cfg, plan)
    status = check_items(store, KIND, [k for k in keys.values() if only is None or k in only])
    if status.missing:
        by_key = {keys[n]: t for n, t in texts.items()}
        seen_by_key = {keys[n]: s for n, s in seen.items()}
        adapter = make_adapter(cfg.model, plan.model_dir)
        from tasks.training.quantized_base import text_loading  # torch and diffusers: only when encoding

        adapter.text_loading = text_loading(cfg.text)  # text.quantize / text.offload (text_load.py)
        encoders = load_once(models, (KIND, key_of(plan.ids), cfg.model.dtype, adapter.text_loading),
                             adapter.load_text_encoders)
        batches = list(chunks(status.missing, batch_size))
        with BackgroundWrites() as writes:  # an item is written while the next one is encoded
            for batch in progress(batches, "cache_text", len(batches)):
                images = {"images": [seen_images(seen_by_key.get(k)) for k in batch]} if seen_by_key else {}
                encoded = adapter.encode_text(encoders, [by_key[k] for k in batch], **images)
                for k, tensors in zip(batch, encoded):
                    writes.submit(store.put_tensors, KIND, k, tensors, meta={"text": by_key[k]}, recomputable=True)
        log.info("cache_text: encoded %d text(s), reused %d", len(status.missing), len(status.reused))
        del encoders
    captions = sum(n.startswith("caption:") for n in texts)
    live = {"text_encoding": te_lora.LIVE} if te_lora.enabled(cfg) else {}  # report: nodes.cache_text
    if live:
        log.info("cache_text: nothing to encode: text encoding is %s", te_lora.LIVE)
    node_inputs = inputs(cfg, plan)
    return node_result(key_of(node_inputs), keys, status, node_inputs, caption_texts=captions,
                       distinct_texts=len(set(keys.values())), **live)


def key_of_node(cfg: Config, plan: Plan) -> str:
    return key_of(inputs(cfg, plan))
