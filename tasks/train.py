"""Node train: a LoRA on the denoiser (peft), trained from cached latents and text only.

The VAE and the text encoders are never loaded here: every batch comes from the store."""
from __future__ import annotations

import logging
import random
import tempfile
from pathlib import Path

import numpy as np
import torch
from diffusers.optimization import get_scheduler
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from tasks import cache_latents, cache_text
from tasks.hashing import key_of
from tasks.items import check_items, node_result
from tasks.models import make_adapter
from tasks.store import Store

CODE_VERSION = "2"  # 2: the LoRA file carries its peft config (alpha)
KIND = "lora"
log = logging.getLogger("loraflow")


def inputs(cfg: dict, plan: dict, latent_keys: dict[str, str], text_keys: dict[str, str]) -> dict:
    """The training key covers the base denoiser, every hyper-parameter and each item's (latent, caption) pair.

    A live-encoded caption is named by the key its cached item would have (text + encoders + settings)."""
    pairs = {f"item:{it['name']}": key_of([latent_keys[it["name"]], _caption_key(cfg, plan, text_keys, it)])
             for it in plan["items"]}
    return {"node": "train", "code": CODE_VERSION, "family": plan["family"], "denoiser": plan["ids"]["denoiser"],
            "dtype": cfg["model"]["dtype"], "text.cache": cfg["text"]["cache"],
            **{f"train.{k}": v for k, v in cfg["train"].items()}, **pairs}


def _caption_key(cfg: dict, plan: dict, text_keys: dict, item: dict) -> str:
    return text_keys.get(f"caption:{item['name']}") or cache_text.text_key(cfg, plan, item["caption"])


class _Captions:
    """Caption tensors for item i: from the store (text.cache=true), or encoded live one caption at a
    time (text.cache=false) -- one at a time so both paths give the same bytes, hence the same loss."""

    def __init__(self, cfg, plan, store, adapter, text_keys):
        self.captions = [it["caption"] for it in plan["items"]]
        if cfg["text"]["cache"]:
            self.cached = [store.get_tensors(cache_text.KIND, text_keys[f"caption:{it['name']}"]) for it in plan["items"]]
        else:
            self.cached, self.adapter = None, adapter
            self.encoders = adapter.load_text_encoders()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.cached is not None:
            return self.cached[i]
        return self.adapter.encode_text(self.encoders, [self.captions[i]])[0]


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator("cpu").manual_seed(seed)


def _batches(n: int, batch_size: int, generator: torch.Generator):
    """Endless stream of index batches: a fresh seeded permutation each epoch, the last partial batch kept."""
    while True:
        order = torch.randperm(n, generator=generator).tolist()
        for i in range(0, n, batch_size):
            yield order[i:i + batch_size]


def _stack(dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([d[k] for d in dicts]) for k in dicts[0]}


def train_lora(cfg: dict, plan: dict, store: Store, latent_keys: dict, text_keys: dict, out_dir: Path) -> tuple[Path, list]:
    """The training loop, top to bottom. Returns (LoRA file, logged losses)."""
    tc = cfg["train"]
    adapter = make_adapter(cfg["model"], plan["model_dir"])
    names = [it["name"] for it in plan["items"]]
    latents = [store.get_tensors(cache_latents.KIND, latent_keys[n])["latents"] for n in names]
    texts = _Captions(cfg, plan, store, adapter, text_keys)

    generator = seed_everything(int(tc["seed"]))
    denoiser = adapter.load_denoiser()
    denoiser.requires_grad_(False)
    alpha = tc["alpha"] if tc["alpha"] is not None else tc["rank"]
    denoiser.add_adapter(LoraConfig(r=tc["rank"], lora_alpha=alpha, init_lora_weights="gaussian",
                                    target_modules=list(tc["target_modules"] or adapter.default_lora_targets())))
    params = [p for p in denoiser.parameters() if p.requires_grad]
    for p in params:  # LoRA weights train in fp32 whatever the base dtype
        p.data = p.data.float()
    if tc["optimizer"] != "adamw":
        raise ValueError(f"train.optimizer={tc['optimizer']!r}: only 'adamw' is available")
    optimizer = torch.optim.AdamW(params, lr=tc["lr"], weight_decay=tc["weight_decay"])
    lr_schedule = get_scheduler(tc["lr_scheduler"], optimizer, num_warmup_steps=tc["warmup_steps"],
                                num_training_steps=tc["max_steps"])
    scheduler = adapter.load_train_scheduler()
    denoiser.train()

    losses, window = [], []
    batches = _batches(len(names), min(tc["batch_size"], len(names)), generator)
    log.info("train: %d steps, %d images, batch %d, rank %d, lr %g, %d trainable parameters",
             tc["max_steps"], len(names), tc["batch_size"], tc["rank"], tc["lr"], sum(p.numel() for p in params))
    for step in range(1, tc["max_steps"] + 1):
        idx = next(batches)
        batch_latents = torch.stack([latents[i] for i in idx]).to(adapter.dtype)
        loss = adapter.training_loss(denoiser, batch_latents, _stack([texts[i] for i in idx]), tc, scheduler, generator)
        loss.backward()
        if tc["max_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(params, tc["max_grad_norm"])
        optimizer.step()
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        window.append(loss.item())
        if step % tc["log_every"] == 0 or step == tc["max_steps"]:
            mean = sum(window) / len(window)
            losses.append({"step": step, "loss": mean})
            log.info("train: step %4d/%d  loss %.4f  lr %.2e", step, tc["max_steps"], mean, lr_schedule.get_last_lr()[0])
            window = []

    state = get_peft_model_state_dict(denoiser)
    return adapter.save_lora(state, out_dir, denoiser.peft_config["default"].to_dict()), losses


def run(cfg: dict, plan: dict, store: Store, latent_keys: dict, text_keys: dict) -> dict:
    node_inputs = inputs(cfg, plan, latent_keys, text_keys)
    key = key_of(node_inputs)
    status = check_items(store, KIND, [key])
    if status.missing:
        with tempfile.TemporaryDirectory(dir=store.root / "tmp") as tmp:
            lora_file, losses = train_lora(cfg, plan, store, latent_keys, text_keys, Path(tmp))
            store.put_file(KIND, key, lora_file, meta={"losses": losses, "family": plan["family"]})
    meta = store.meta(KIND, key)
    return node_result(key, {"lora": key}, status, node_inputs, lora=str(store.get_path(KIND, key)),
                       losses=meta.get("losses", []))


def key_of_node(cfg: dict, plan: dict, latent_keys: dict, text_keys: dict) -> str:
    return key_of(inputs(cfg, plan, latent_keys, text_keys))
