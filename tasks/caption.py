"""Node caption (first, before validate reads the captions): a caption for each image that needs one
(data.captions, tasks/captioning/select.py) from a vision-language model (caption.model) or an
OpenAI-compatible server (caption.endpoint), cached per image: the key is the image's bytes, the captioner's
identity, the prompt and the generation settings. One new image captions one image; a changed prompt
re-captions all; a hand-written caption is never replaced. The store holds the captions; the run folder gets
`captions/<item>.txt`, the image folder only with caption.beside_images=true. validate then reads them as it
reads caption files."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from tasks.captioning import CaptionError
from tasks.captioning import memory as caption_memory
from tasks.captioning.files import write_beside, write_run_captions, written_by_loraflow
from tasks.captioning.select import Wanted, wanted
from tasks.config import Config
from tasks.items import BackgroundWrites, check_items, chunks, node_result, progress
from tasks.store import Store
from tasks.store.hashing import digest_tree, key_of

CODE_VERSION = "1"
KIND = "caption"
TINY = "tiny_vlm"
TINY_VERSION = "1"  # tasks/models/tiny/tiny_vlm.py's output
log = logging.getLogger("loraflow")


def settings(cfg: Config) -> dict:
    """The generation settings in every caption's key (the seed only where it is used; caption.quantize where
    set: a quantized captioner's captions never stand in for another's, as text.quantize in cache_text's keys)."""
    c = cfg.caption
    return {"prompt": c.prompt, "max_new_tokens": c.max_new_tokens, "temperature": c.temperature,
            **({"quantize": c.quantize} if c.quantize != "none" and not c.endpoint else {}),
            **({} if c.endpoint else {"dtype": c.dtype or cfg.model.dtype}),  # a bf16 captioner writes other words
            **({"seed": c.seed} if c.temperature > 0 else {}), **({"max_pixels": c.max_pixels} if c.max_pixels else {})}


def model_folder(cfg: Config, store: Store) -> Path:
    """The captioner's folder: tiny_vlm built into the store once, a local folder, or a hub snapshot."""
    name = cfg.caption.model
    if name == TINY:
        from tasks.models.tiny.tiny_vlm import build_tiny_vlm

        key = key_of({"tiny": TINY, "builder": TINY_VERSION})
        if not store.valid("models", key):
            store.put("models", key, "", lambda p: build_tiny_vlm(p), meta={"tiny": TINY})
        return store.get_path("models", key)
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise CaptionError(f"caption.model={name}: no config.json in this folder; point it at a vision-language "
                               "model's folder (e.g. a download of Qwen/Qwen2.5-VL-7B-Instruct)")
        return local
    if name.startswith(("/", ".", "~")) or name.count("/") != 1:
        raise CaptionError(f"caption.model={name}: no such folder; give a vision-language model's folder, a hub id "
                           f"(e.g. Qwen/Qwen2.5-VL-7B-Instruct) or {TINY}, or set data.captions=file")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name))
    except Exception as e:  # offline, unknown id, gated: the user's to fix
        raise CaptionError(f"caption.model={name}: not a local folder and not loadable from the hub "
                           f"({type(e).__name__}); download it and give its folder, or set data.captions=file") from None


def identity(cfg: Config, store: Store) -> tuple[dict, Path | None]:
    """(the captioner's identity in the keys, its folder or None for an endpoint)."""
    c = cfg.caption
    if c.endpoint:
        return {"endpoint": c.endpoint.rstrip("/"), "model": c.model}, None
    folder = model_folder(cfg, store)
    return {"model": digest_tree(folder, digest=store.file_digest)}, folder


def params(cfg: Config, who: dict) -> dict:
    return {"node": "caption", "code": CODE_VERSION, "captioner": who, **settings(cfg)}


def item_keys(cfg: Config, store: Store, images: list[Wanted], who: dict) -> dict[str, str]:
    p = params(cfg, who)
    return {w.name: key_of({**p, "image": store.file_digest(w.image)}) for w in images}


def _captioner(cfg: Config, folder: Path | None):
    c = cfg.caption
    if folder is None:
        from tasks.captioning.endpoint import EndpointCaptioner

        return EndpointCaptioner(c.endpoint, c.model, settings(cfg) | {"seed": c.seed}, c.timeout)
    from tasks.captioning.vlm import Captioner
    from tasks.runtime import cuda_available
    from tasks.training.quantized_base import text_loading

    dtype = c.dtype or cfg.model.dtype
    loading = dataclasses.replace(text_loading(c), keep=caption_memory.KEEP, head=True)  # the head, unquantized
    return Captioner(folder, dtype, loading, "cuda" if cuda_available() else "cpu",
                     settings(cfg) | {"seed": c.seed, "max_pixels": c.max_pixels})


def _images(batch: list[Wanted]):
    """The batch's images as RGB (EXIF orientation applied, as training sees them); None for one that cannot
    be read (validate reports it)."""
    from tasks.data.images import load_image

    out = []
    for w in batch:
        try:
            out.append(load_image(w.image))
        except Exception:  # noqa: BLE001 - any decoder error: the image is validate's to report
            out.append(None)
    return out


def _compute(cfg: Config, store: Store, todo: list[Wanted], keys: dict[str, str], folder: Path | None,
             batch: int) -> int:
    """Caption `todo`, `batch` images a generate call, and store each caption as it is made; returns the number
    captioned."""
    captioner, done = _captioner(cfg, folder), 0
    try:
        batches = list(chunks(todo, max(1, batch)))
        with BackgroundWrites() as writes:
            for batch in progress(batches, "caption", len(batches)):
                readable = [(w, img) for w, img in zip(batch, _images(batch)) if img is not None]
                if not readable:
                    continue
                if folder is None:
                    texts = captioner.caption([img for _, img in readable], [w.name for w, _ in readable])
                else:
                    texts = captioner.caption([img for _, img in readable])
                for (w, _), text in zip(readable, texts):
                    if store.exists(KIND, keys[w.name]):  # data.captions=regenerate: the new one replaces it
                        store.discard(KIND, keys[w.name])
                    writes.submit(store.put_json, KIND, keys[w.name], {"caption": text},
                                  meta={"image": w.name})
                    done += 1
    finally:
        captioner.close()
    return done


def planned(cfg: Config, store: Store) -> tuple[list[Wanted], dict[str, str], dict, int]:
    """(the images to caption, their caption keys by item, the node's inputs, hand-written captions kept);
    loads no model (flows.explain reads it too)."""
    images, kept = wanted(cfg.data)
    who, _ = identity(cfg, store) if images else ({}, None)
    keys = item_keys(cfg, store, images, who) if images else {}
    node_inputs = {"node": "caption", "code": CODE_VERSION, "mode": cfg.data.captions,
                   **({**params(cfg, who), **{f"image:{n}": k for n, k in keys.items()}} if images else {})}
    return images, keys, node_inputs, kept


def stored_captions(store: Store, images: list[Wanted], keys: dict[str, str]) -> dict[str, str]:
    """{image file: caption} of the images whose caption the store holds."""
    return {w.image: store.get_json(KIND, keys[w.name])["caption"] for w in images if store.exists(KIND, keys[w.name])}


def run(cfg: Config, store: Store, run_dir: Path | None = None) -> dict:
    """The node: captions stored, the run folder's copies written; the result names every caption by image."""
    images, keys, node_inputs, kept = planned(cfg, store)
    status, memory = check_items(store, KIND, keys.values()), None
    if cfg.data.captions == "regenerate":  # every caption anew (a sampling captioner, a new server behind a URL)
        status.missing, status.reused = list(dict.fromkeys(keys.values())), []
    if status.missing:
        missing = set(status.missing)
        todo = list({keys[w.name]: w for w in images if keys[w.name] in missing}.values())
        log.info("caption: %d image(s) to caption with %s", len(todo), cfg.caption.endpoint or cfg.caption.model)
        folder, batch = identity(cfg, store)[1], max(cfg.caption.batch_size, 1)
        if folder is not None:  # the preflight: refused here, before loading, when it cannot fit
            memory = caption_memory.check(cfg, folder)
            batch = memory["batch"]  # caption.batch_size=0: the largest the card allows
            log.info("caption: the captioner needs about %.2f GiB (%s, %d image(s) a batch)", memory["device_gb"],
                     memory["setting"], batch)
        _compute(cfg, store, todo, keys, folder, batch)
    captions = stored_captions(store, images, keys)
    by_name = {w.name: captions[w.image] for w in images if w.image in captions}
    if run_dir is not None and by_name:
        write_run_captions(run_dir, by_name)
    if cfg.caption.beside_images:
        _beside(images, captions)
    empty = sorted(n for n, t in by_name.items() if not t)
    if images:
        log.info("caption: %d image(s) captioned by the model (%d computed, %d reused), %d hand-written caption(s) "
                 "kept", len(by_name), len(status.missing), len(status.reused), kept)
    return node_result(key_of(node_inputs), keys, status, node_inputs, captions=captions,
                       summary={"mode": cfg.data.captions, **({} if cfg.data.captions == "file" else {
                           "captioner": cfg.caption.endpoint or cfg.caption.model, "captioned": len(by_name),
                           "hand_written": kept, "empty": empty,
                           **({"memory_estimate": memory} if memory else {})})})


def _beside(images: list[Wanted], captions: dict[str, str]) -> None:
    """caption.beside_images: each folder's captions next to its images (hand-written ones left alone)."""
    folders: dict[str, dict[str, str]] = {}
    for w in images:
        if w.image in captions and captions[w.image]:
            folders.setdefault(w.folder, {})[w.caption_rel] = captions[w.image]
    for folder, texts in folders.items():
        n = write_beside(Path(folder), texts, written_by_loraflow(Path(folder)))
        if n:
            log.info("caption: wrote %d caption file(s) beside the images in %s (caption.beside_images)", n, folder)

