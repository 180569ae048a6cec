"""Node cache_text: every distinct text (captions, sample prompts and negatives, the empty prompt) encoded once."""
from __future__ import annotations

import logging

from tasks.data import augment
from tasks.models import text_encoder_lora as te_lora
from tasks.store.hashing import digest_text, key_of
from tasks.items import BackgroundWrites, check_items, chunks, load_once, node_result, progress
from tasks.models import make_adapter
from tasks.runtime import runtime
from tasks.store import Store

CODE_VERSION = "1"
KIND = "text"
log = logging.getLogger("loraflow")


def params(cfg: dict, plan: dict) -> dict:
    return {"node": "cache_text", "code": CODE_VERSION, "encoders": plan["ids"]["text"],
            "max_sequence_length": cfg["model"]["max_sequence_length"], "dtype": cfg["model"]["dtype"],
            "family": plan["family"], **runtime()}


def caption_aug(cfg: dict) -> augment.CaptionAug:
    return augment.from_config(cfg["data"], cfg["text"], cfg["train"]["max_steps"])


def caption_name(item: str, label: str) -> str:
    """`caption:<item>` for the caption as written, `caption:<item>:<label>` for an augmentation variant."""
    return f"caption:{item}" if label == "full.v0" else f"caption:{item}:{label}"


def caption_owner(item: dict) -> str:
    """The item whose cached caption texts this item trains with: a flipped twin reads its source's."""
    return item.get("flip_of", item["name"])


def caption_texts_of(cfg: dict):
    """item -> caption_texts of that item, with the augmentation settings read once (100,000 items)."""
    aug = caption_aug(cfg)
    if augment.text_mode(te_lora.text_settings(cfg), aug) != "cached":
        return lambda item: {}
    seed = cfg["text"]["variants_seed"]
    return lambda item: augment.cached_texts(item["caption"], aug, seed)


def caption_texts(cfg: dict, plan: dict, item: dict) -> dict[str, str]:
    """label -> text of every caption text training reads from the cache for this item (with augmentation:
    each variant and warm-up truncation); empty when training encodes captions itself."""
    return caption_texts_of(cfg)(item)


def named_texts(plan: dict, cfg: dict) -> dict[str, str]:
    """Every text the run caches, by a readable name (for `changed` in the report). Captions (and their
    augmentation variants) only when training reads them from the cache; otherwise it encodes them. None
    with train.text_encoder_lr: train and sample encode every text with the encoders being trained."""
    if te_lora.enabled(cfg):
        return {}
    texts_of = caption_texts_of(cfg)
    texts = {caption_name(it["name"], label): text for it in plan["items"] if "flip_of" not in it
             for label, text in texts_of(it).items()}  # a flipped twin has its source's texts
    for p in plan["prompts"]:
        texts[f"prompt:{p['line']}"] = p["prompt"]
        if p["negative"]:
            texts[f"negative:{p['line']}"] = p["negative"]
    texts["empty"] = ""  # the unconditional prompt (caption dropout, CFG)
    return texts


def text_key(cfg: dict, plan: dict, text: str) -> str:
    return key_of({**params(cfg, plan), "text": text})


def item_keys(cfg: dict, plan: dict) -> dict[str, str]:
    p = params(cfg, plan)
    return {name: key_of({**p, "text": text}) for name, text in named_texts(plan, cfg).items()}


def inputs(cfg: dict, plan: dict) -> dict:
    return {**params(cfg, plan), **{n: digest_text(t) for n, t in named_texts(plan, cfg).items()}}


# Batch size 1: an item must not depend on its batch neighbours (see cache_latents).
def run(cfg: dict, plan: dict, store: Store, batch_size: int = 1, only: set[str] | None = None,
        models: dict | None = None) -> dict:
    """`only`: compute just these item keys (a shard of the node's missing items, flows/shards.py);
    `models`: a worker process's memo of loaded models (tasks/items.py: load_once)."""
    texts = named_texts(plan, cfg)
    keys = item_keys(cfg, plan)
    status = check_items(store, KIND, [k for k in keys.values() if only is None or k in only])
    if status.missing:
        by_key = {keys[n]: t for n, t in texts.items()}
        adapter = make_adapter(cfg["model"], plan["model_dir"])
        encoders = load_once(models, (KIND, key_of(plan["ids"]), cfg["model"]["dtype"]), adapter.load_text_encoders)
        batches = list(chunks(status.missing, batch_size))
        with BackgroundWrites() as writes:  # an item is written while the next one is encoded
            for batch in progress(batches, "cache_text", len(batches)):
                encoded = adapter.encode_text(encoders, [by_key[k] for k in batch])
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


def key_of_node(cfg: dict, plan: dict) -> str:
    return key_of(inputs(cfg, plan))
