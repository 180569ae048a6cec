"""Figures 1-3: loraflow's nodes against bare diffusers/transformers/peft loops doing the same work,
on the mid-sized Flux (bench.common.MID_ARCH), alternated in one process, medians reported.

Our side calls the node functions exactly as the flow does (`tasks.<node>.run(cfg, plan, store, ...)`), with
the config composed by Hydra like any run and the plan from `tasks.validate.run`. The bare side uses only
diffusers/transformers/peft/safetensors and the same files."""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from bench.common import MID_ARCH, MID_RES, MID_SEQ, alternate, median
from tasks.config import Config
from tasks.plan import Plan


log = logging.getLogger("loraflow")
_KEEP = {"models", "latents", "text", "filedigests", "tmp", "runs"}  # store folders figure 3 keeps between runs


# -- setup -------------------------------------------------------------------------------------------------
def mid_cfg(data_dir: Path, prompts: Path, store_root: Path, train: dict) -> dict:
    """The run config exactly as `python -m flows.train` composes it, with the mid-sized model."""
    from tasks.config import compose, resolve_paths

    overrides = [f"data.dir={data_dir}", f"sample.prompts_file={prompts}", f"store.root={store_root}",
                 f"data.resolution={MID_RES}", f"model.max_sequence_length={MID_SEQ}",
                 *(f"train.{k}={v}" for k, v in train.items())]
    cfg = resolve_paths(compose("train", overrides)[0])
    cfg.model.arch = dict(MID_ARCH)  # the dict-valued key, set on the composed config
    return cfg


def plan_for(cfg: Config):
    from tasks import validate
    from tasks.store import Store

    store = Store(cfg.store.root)
    return validate.run(cfg, store), store


def paired_ratios(runs: dict) -> list[float]:
    """ours/bare per round (the two ran back to back): shows drift from other load on the machine."""
    return [o / b for o, b in zip(runs["ours"], runs["bare"])]


# -- figure 1: latent caching ------------------------------------------------------------------------------
def cache_latents_seconds(cfg: Config, plan: Plan, store, result: dict) -> float:
    """Seconds of one `cache_latents.run` into an empty latents kind: every item computed and written (also
    bench/video_cache.py's side). `result["items"]` gets the run's latent keys."""
    from tasks import cache_latents

    shutil.rmtree(store.root / cache_latents.KIND, ignore_errors=True)  # every latent must be computed
    t = time.perf_counter()
    res = cache_latents.run(cfg, plan, store)
    dt = time.perf_counter() - t
    assert res["computed"] == len(plan.items), res["computed"]
    result["items"] = res["items"]
    return dt


def bench_latents(cfg: Config, plan: Plan, store, scratch: Path, reps: int) -> dict:
    from diffusers import AutoencoderKL

    images = [it["image"] for it in plan.items]
    w, h = plan.size
    model_dir = plan.model_dir
    result = {}

    def ours() -> float:
        return len(images) / cache_latents_seconds(cfg, plan, store, result)

    def bare() -> float:
        out = scratch / "bare_latents"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        t = time.perf_counter()
        # on the device and in the dtype ours uses (model.dtype; CUDA when there is one: bench/gpu.py)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae", use_safetensors=True,
                                            dtype=getattr(torch, cfg.model.dtype)).to(device).eval()
        with torch.no_grad():
            for i, path in enumerate(images):
                img = Image.open(path).convert("RGB").resize((w, h), Image.Resampling.BICUBIC)
                x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
                x = x.contiguous()[None]  # NCHW-contiguous, as ours (the permuted view is channels-last)
                z = vae.encode(x.to(device, vae.dtype)).latent_dist.mode()
                z = (z - vae.config.shift_factor) * vae.config.scaling_factor
                save_file({"latents": z[0].contiguous().cpu()}, str(out / f"{i}.safetensors"))
        dt = time.perf_counter() - t
        shutil.rmtree(out, ignore_errors=True)
        return len(images) / dt

    runs = alternate({"ours": ours, "bare": bare}, reps)
    return {"ours_images_per_s": runs["ours"], "bare_images_per_s": runs["bare"],
            "ours_median": median(runs["ours"]), "bare_median": median(runs["bare"]),
            "ratio": median(runs["ours"]) / median(runs["bare"]), "paired_ratios": paired_ratios(runs),
            "images": len(images), "size": [w, h],
            "latent_keys": result["items"]}


# -- figure 2: text caching --------------------------------------------------------------------------------
def distinct_texts(plan: Plan) -> list[str]:
    texts = [it["caption"] for it in plan.items]
    for p in plan.prompts:
        texts.append(p["prompt"])
        if p["negative"]:
            texts.append(p["negative"])
    texts.append("")
    return list(dict.fromkeys(texts))


def bench_text(cfg: Config, plan: Plan, store, scratch: Path, reps: int) -> dict:
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    from tasks import cache_text

    texts = distinct_texts(plan)
    model_dir, max_len = plan.model_dir, cfg.model.max_sequence_length
    result = {}

    def ours() -> float:
        shutil.rmtree(store.root / cache_text.KIND, ignore_errors=True)
        t = time.perf_counter()
        res = cache_text.run(cfg, plan, store)
        dt = time.perf_counter() - t
        assert res["computed"] == len(texts), (res["computed"], len(texts))
        result["items"] = res["items"]
        return len(texts) / dt

    def bare() -> float:
        out = scratch / "bare_text"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        t = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(model_dir, subfolder="tokenizer")
        tok2 = AutoTokenizer.from_pretrained(model_dir, subfolder="tokenizer_2")
        clip = CLIPTextModel.from_pretrained(model_dir, subfolder="text_encoder", use_safetensors=True).eval()
        t5 = T5EncoderModel.from_pretrained(model_dir, subfolder="text_encoder_2", use_safetensors=True).eval()
        with torch.no_grad():
            for i, text in enumerate(texts):  # one text at a time, like ours (batch-invariant bytes)
                ids = tok([text], padding="max_length", max_length=tok.model_max_length, truncation=True,
                          return_tensors="pt").input_ids
                pooled = clip(ids, output_hidden_states=False).pooler_output
                ids2 = tok2([text], padding="max_length", max_length=max_len, truncation=True,
                            return_tensors="pt").input_ids
                embeds = t5(ids2, output_hidden_states=False)[0]
                mask = (ids2 != tok2.pad_token_id).to(torch.int64)
                save_file({"prompt_embeds": embeds[0].contiguous(), "pooled_prompt_embeds": pooled[0].contiguous(),
                           "attention_mask": mask[0].contiguous()}, str(out / f"{i}.safetensors"))
        dt = time.perf_counter() - t
        shutil.rmtree(out, ignore_errors=True)
        return len(texts) / dt

    runs = alternate({"ours": ours, "bare": bare}, reps)
    return {"ours_texts_per_s": runs["ours"], "bare_texts_per_s": runs["bare"],
            "ours_median": median(runs["ours"]), "bare_median": median(runs["bare"]),
            "ratio": median(runs["ours"]) / median(runs["bare"]), "paired_ratios": paired_ratios(runs), "texts": len(texts),
            "text_keys": result["items"]}


# -- figure 3: train step ----------------------------------------------------------------------------------
class _StepTimes(logging.Handler):
    """Timestamps (perf_counter) of the train node's per-step log lines (train.log_every=1)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.times: list[float] = []

    def emit(self, record):
        if record.getMessage().startswith("train: step"):
            self.times.append(time.perf_counter())


def bench_train(cfg: Config, plan: Plan, store, latent_keys: dict, text_keys: dict, reps: int, warm_steps: int) -> dict:
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig

    from tasks import cache_latents, cache_text, train
    from tasks.models import make_adapter
    from tasks.training.memory import lora_targets

    tc = cfg.train
    steps, bs, rank = tc.max_steps, tc.batch_size, tc.rank
    assert tc.log_every == 1 and steps > warm_steps + 1
    targets = lora_targets(tc, make_adapter(cfg.model, plan.model_dir))
    names = [it["name"] for it in plan.items]

    handler = _StepTimes()
    log.addHandler(handler)
    old_level, old_propagate = log.level, log.propagate
    log.setLevel(logging.INFO)
    log.propagate = False

    def ours() -> list[float]:
        # The LoRA must be trained again from step 1: drop every stored entry but the model and the caches
        # (the LoRA and, since train.resume=auto, any checkpoint it would continue from).
        for entry in store.root.iterdir():
            if entry.is_dir() and entry.name not in _KEEP:
                shutil.rmtree(entry, ignore_errors=True)
        handler.times.clear()
        res = train.run(cfg, plan, store, latent_keys, text_keys)
        assert res["computed"] == 1
        t = handler.times
        assert len(t) == steps, f"expected {steps} per-step log lines from the train node, got {len(t)}"
        return [b - a for a, b in zip(t, t[1:])][warm_steps:]  # interval i = step i+2; drop warm-up steps

    # The same cached tensors, read once from the store with plain safetensors.
    latents = [load_file(str(store.get_path(cache_latents.KIND, latent_keys[n])))["latents"] for n in names]
    texts = [load_file(str(store.get_path(cache_text.KIND, text_keys[f"caption:{n}"]))) for n in names]

    def bare() -> list[float]:
        torch.manual_seed(tc.seed)
        g = torch.Generator().manual_seed(tc.seed)
        model = FluxTransformer2DModel.from_pretrained(plan.model_dir, subfolder="transformer",
                                                       use_safetensors=True)
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
        model.train()
        c, hh, ww = latents[0].shape
        img_ids = FluxPipeline._prepare_latent_image_ids(bs, hh // 2, ww // 2, "cpu", torch.float32)
        txt_ids = torch.zeros(texts[0]["prompt_embeds"].shape[0], 3)
        guidance = torch.full((bs,), float(tc.guidance))
        times, order = [], []
        for step in range(steps):
            t = time.perf_counter()
            if len(order) < bs:
                order += torch.randperm(len(names), generator=g).tolist()
            idx, order = order[:bs], order[bs:]
            x0 = torch.stack([latents[i] for i in idx])
            emb = torch.stack([texts[i]["prompt_embeds"] for i in idx])
            pooled = torch.stack([texts[i]["pooled_prompt_embeds"] for i in idx])
            noise = torch.randn(x0.shape, generator=g)
            sigma = torch.rand(bs, generator=g)
            xt = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
            packed = FluxPipeline._pack_latents(xt, bs, c, hh, ww)
            target = FluxPipeline._pack_latents(noise - x0, bs, c, hh, ww)
            pred = model(hidden_states=packed, timestep=sigma, guidance=guidance, pooled_projections=pooled,
                         encoder_hidden_states=emb, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred, target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, tc.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            times.append(time.perf_counter() - t)
        return times[warm_steps + 1:]  # same steps as ours: drop step 1 and the warm-up steps

    try:
        runs = alternate({"ours": ours, "bare": bare}, reps, warmup=0)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        log.propagate = old_propagate
    ours_all = [t for r in runs["ours"] for t in r]
    bare_all = [t for r in runs["bare"] for t in r]
    return {"ours_step_s": ours_all, "bare_step_s": bare_all, "ours_median": median(ours_all),
            "bare_median": median(bare_all), "ratio": median(ours_all) / median(bare_all),
            "steps_per_run": steps, "measured_steps_per_run": steps - warm_steps - 1, "batch_size": bs,
            "rank": rank, "lora_targets": targets}
