"""Node train: a LoRA on the denoiser (peft), trained from cached latents and text only.

The VAE and the text encoders are never loaded here: every batch comes from the store."""
from __future__ import annotations

import copy
import logging
import sys
import time
import warnings
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from tqdm.auto import tqdm

from tasks.data import augment, controls, masks, video
from tasks import cache_latents, cache_text
from tasks.training import checkpoint_samples, checkpoints, interrupt, validation
from tasks.models import text_encoder_lora as te_lora
from tasks.training.checkpoint_samples import CheckpointSampler, to_tensorboard
from tasks.training.checkpoints import checkpoint_key, latest_checkpoint, load_checkpoint as _load_checkpoint
from tasks.training.checkpoints import save_checkpoint as _save_checkpoint  # tests wrap it to fail after a save
from tasks.store.formats import canonicalize_safetensors
from tasks.store.hashing import key_int, key_of
from tasks.items import Memo as _Memo, check_items, node_result, prefetch
from tasks.lazy import lazy
from tasks.models import make_adapter
from tasks.store import Store
from tasks.training.train_key import CODE_VERSION, inputs, key_of_node, trajectory_key  # noqa: F401 (the node's key, re-exported)
from tasks.training.train_setup import (make_accelerator, make_ema, make_optimizer, precision, prepare_denoiser, save_ema,
                               seed_everything, sum_gradients, update_ema)

torch = lazy("torch")
optimization = lazy("diffusers.optimization")

KIND = "lora"
CHECKPOINT_KIND = checkpoints.KIND
EMA_KIND = "lora_ema"  # train.ema_decay: the EMA LoRA, under the train key
log = logging.getLogger("loraflow")

class _Captions:
    """Caption tensors per item and step.

    cached: the augmentation's label for this step (`augment.choose`) picks a stored variant, or the
    stored empty prompt when the caption is dropped; fresh/live: a new draw (`augment.fresh`) encoded
    now, one caption at a time so it gives the bytes the cache would (hence the same loss). With
    train.text_encoder_lr the live path encodes with gradients through the encoders' LoRA (`trained`)."""

    def __init__(self, cfg, plan, store, adapter, text_keys):
        self.items, self.store, self.text_keys = plan["items"], store, text_keys
        self.aug = cache_text.caption_aug(cfg)
        self.mode = augment.text_mode(te_lora.text_settings(cfg), self.aug)
        self.adapter, self.memo = adapter, _Memo(MEMO_ITEMS)  # many variants of big T5 states: bounded
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


class _Latents:
    """Cached latents by item index, read from the store when a batch needs them (in the loader thread
    with CUDA) and kept in a bounded memo: a dataset that does not fit in RAM trains too. The shapes (for
    the buckets) come from the entries' headers."""

    def __init__(self, store: Store, keys: list[str]):
        self.store, self.keys, self.memo = store, keys, _Memo(MEMO_ITEMS)
        self.shapes = [tuple(self._shape(i)) for i in range(len(keys))]

    def _shape(self, i: int):
        # Up to the memo's size, the latent itself is loaded (and verified) once, here; beyond it, its header.
        if len(self.memo) < self.memo.size:
            return self[i]["latents"].shape
        return self.store.tensor_shapes(cache_latents.KIND, self.keys[i])["latents"]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """"latents", and for SDXL the image's "original_size" and "crop_top_left" (its size conditioning)."""
        return self.memo.get_or_load(i, lambda: self.store.get_tensors(cache_latents.KIND, self.keys[i]))


def _stack(dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([d[k] for d in dicts]) for k in dicts[0]}


@dataclass
class _Batch:
    """One step's share of this process, on the CPU: its loss weight, one generator per item (the caption
    choice already drawn from them; noise and timestep are drawn next), latents and text tensors."""
    weight: float
    generators: list[torch.Generator]
    latents: torch.Tensor
    text: dict[str, torch.Tensor]
    item_weights: list[float] | None = None  # per-item loss weights (reg images); None: all 1
    loss_mask: torch.Tensor | None = None  # uint8 [B, 1, H, W] pixel masks (data.mask_dir / alpha_mask)


def overlap_loading() -> bool:
    """Whether batches are prepared in a thread, one step ahead (with CUDA; the tests force it on the CPU)."""
    return torch.cuda.is_available()


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """Page-locked with CUDA, so the copy to the GPU is asynchronous; else (or a trained encoder's output) as is."""
    return t.pin_memory() if torch.cuda.is_available() and t.device.type == "cpu" and not t.requires_grad else t


def logged_losses(step_losses: list[float], every: int) -> list[dict]:
    """Mean loss per window of `every` steps (and the last, partial one), as the log prints them."""
    return [{"step": min(i + every, len(step_losses)), "loss": sum(w) / len(w)}
            for i in range(0, len(step_losses), every) if (w := step_losses[i:i + every])]


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def train_lora(cfg: dict, plan: dict, store: Store, latent_keys: dict, text_keys: dict, out_dir: Path,
               trajectory: str, run_dir: Path | None = None, on_samples: list | None = None) -> dict:
    """The training loop, top to bottom. Runs as one process or as each of `train.num_processes` (data
    parallel: every step's batch is split across processes, gradients summed with the loss weights of
    `my_share`). Returns the LoRA file, per-step losses, the step it continued from, and the samples
    rendered during training (the main process's view; the others return None). `run_dir`: TensorBoard
    logs go to its tensorboard/, samples rendered during training to its samples/step_<k>/ as they are
    made; `on_samples`: more callbacks (step, paths) for them (the flow's Prefect artifact)."""
    tc = cfg["train"]
    adapter = make_adapter(cfg["model"], plan["model_dir"])
    names = [it["name"] for it in plan["items"]]
    latents = _Latents(store, [latent_keys[n] for n in names])
    mask_keys = [latent_keys.get(masks.PREFIX + n) for n in names]  # masked loss: tasks/data/masks.py
    control_keys = [[latent_keys[controls.item_name(it["name"], k)] for k in range(len(it.get("controls", [])))]
                    for it in plan["items"]]  # edit pairs: each item's control latents (tasks/data/controls.py)
    texts = _Captions(cfg, plan, store, adapter, text_keys)

    seed = int(tc["seed"])
    seed_everything(seed)
    tensorboard = run_dir / "tensorboard" if run_dir and tc["log_with"] == "tensorboard" else None
    accelerator = make_accelerator(precision(cfg), tensorboard)
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    denoiser, named = prepare_denoiser(adapter, cfg)
    encoders = texts.trained  # train.text_encoder_lr: LoRA'd after the denoiser (its initial weights as without)
    named, groups = te_lora.add_to_training(adapter, encoders, tc, named)
    params = list(named.values())
    denoiser.to(accelerator.device)
    optimizer = accelerator.prepare_optimizer(make_optimizer(tc, groups))
    ema = make_ema(tc, named)  # train.ema_decay (None: off)
    lr_schedule = optimization.get_scheduler(tc["lr_scheduler"], optimizer, num_warmup_steps=tc["warmup_steps"],
                                             num_training_steps=tc["max_steps"])
    scheduler = adapter.load_train_scheduler()

    sampler = CheckpointSampler(cfg, plan, store, adapter, run_dir / "samples" if run_dir else None,
                                [to_tensorboard(accelerator), *(on_samples or [])],
                                live_text=None if encoders is None else te_lora.live_prompts(adapter, encoders))
    step_losses, start, val_losses = [], 0, []
    held = plan.get("validation_items", [])  # data.validation_split: scored, never drawn (repeats 0)
    if held:
        val_latents = _Latents(store, [latent_keys[n] for n in held])  # own memos: the loader thread has its own
        by_name = {it["name"]: it for it in plan["items"]}
        val_texts = copy.copy(texts)  # the same encoders (fresh draws), its own memo
        val_texts.items, val_texts.memo = [by_name[n] for n in held], _Memo(MEMO_ITEMS)
        val_controls = validation.held_controls(store, cache_latents.KIND, plan["items"], control_keys, held)
    if tc["resume"] == "auto":  # only the main process discards a corrupt checkpoint; the others skip it
        start = latest_checkpoint(store, trajectory, tc["max_steps"], discard=main)
    if start:
        restored = _load_checkpoint(store, checkpoint_key(trajectory, start), named, optimizer, accelerator.scaler,
                                     ema)
        step_losses = list(restored["losses"])
        val_losses = [v for v in restored.get("validation_loss", []) if v["step"] <= start]
        sampler.rendered = {k: v for k, v in restored.get("samples", {}).items() if sampler.due(int(k))}
        with warnings.catch_warnings():  # stepping the schedule to where it was, without optimizer steps
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(start):
                lr_schedule.step()
        log.info("train: continuing from the stored checkpoint at step %d (steps %d-%d to go)",
                 start, start + 1, tc["max_steps"])

    denoiser.train()
    repeats = [0 if it["name"] in held else it.get("repeats", 1) for it in plan["items"]]
    weights = loss_weights(plan["items"], tc["prior_loss_weight"])
    batch_size, window = min(tc["batch_size"], sum(repeats)), []  # an epoch draws sum(repeats) items
    if main:
        log.info("train: %d steps, %d images, batch %d%s, rank %d, lr %g%s, %d trainable parameters",
                 tc["max_steps"], len(names) - len(held), tc["batch_size"], f" over {world} processes" if world > 1 else "",
                 tc["rank"], tc["lr"], "" if encoders is None else f" (text encoders: {tc['text_encoder_lr']:g})",
                 sum(p.numel() for p in params))
        accelerator.init_trackers("loraflow", config={k: v for k, v in tc.items() if isinstance(v, (int, float, str, bool))})
    groups = buckets_of(latents.shapes, repeats)
    if len(groups) > 1 and main:
        log.info("train: %d buckets, each batch from one: %s", len(groups),
                 ", ".join(f"{video.bucket_name(plan['items'][g[0]], plan['size'])}: {len(g)}" for g in groups))
    accum = tc["gradient_accumulation_steps"]

    def load_step(micro: int) -> _Batch:  # with CUDA: one micro-batch ahead, in a thread (prefetch)
        # Micro-batch m of optimizer step s is number (s-1)*accum + m: batches and draws are those of a run
        # without accumulation at that number, captions follow the optimizer step (token warm-up).
        idx = batch_at(micro, groups, batch_size, seed)
        mine, weight = my_share(len(idx), rank, world)
        gens = item_generators(seed, micro, len(idx))
        gens = [gens[j] for j in mine]
        step = (micro - 1) // accum + 1
        text = _stack([texts.get(idx[j], step, g) for j, g in zip(mine, gens)])
        stored = [latents[idx[j]] for j in mine]  # the size conditioning stored with a latent joins the text
        text.update(_stack([{k: v for k, v in d.items() if k != "latents"} for d in stored]))
        if control_keys[idx[0]]:  # [B, K, C, h, w]: the adapter packs them beside the noisy latents
            text["control_latents"] = torch.stack([torch.stack([store.get_tensors(cache_latents.KIND, k)["latents"]
                                                                for k in control_keys[idx[j]]]) for j in mine])
        item_weights = [weights[idx[j]] for j in mine]
        mask = (torch.stack([store.get_tensors(cache_latents.KIND, mask_keys[idx[j]])["mask"] for j in mine])
                if mask_keys[idx[0]] else None)
        return _Batch(weight, gens, _pinned(torch.stack([d["latents"] for d in stored])),
                      {k: _pinned(v) for k, v in text.items()}, None if set(item_weights) == {1.0} else item_weights,
                      mask)

    progress = tqdm(total=tc["max_steps"], initial=start, desc="train", unit="step", disable=None if main else True)
    steps = list(range(start + 1, tc["max_steps"] + 1))
    t0 = time.perf_counter()
    # With CUDA the next step's batch is read and pinned while the GPU trains on this one. On the CPU a
    # loader thread only contends with the step's own threads (measured: 1.5x the step time on 2 cores).
    # Trained encoders encode in the step itself (lazily, by map), after the previous optimizer step.
    micro = [(s - 1) * accum + m for s in steps for m in range(1, accum + 1)]
    ahead = overlap_loading() and encoders is None
    batches = iter(prefetch(load_step, micro) if ahead else map(load_step, micro))
    for step in steps:
        loss = 0.0  # the step's loss: the mean over its micro-batches (and processes)
        for batch in islice(batches, accum):  # gradients add up; checkpoints fall between optimizer steps
            weight, gens = batch.weight / accum, batch.generators
            batch_latents = batch.latents.to(accelerator.device, adapter.dtype, non_blocking=True)
            text = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.text.items()}
            # reg images' weights reach the loss through the train config (tasks/models/losses.py: item_weights)
            step_cfg = tc if batch.item_weights is None else {**tc, "item_weights": batch.item_weights}
            if batch.loss_mask is not None:  # and the masks, on the latent grid (tasks/models/losses.py: masked)
                grid = masks.on_latent_grid(batch.loss_mask.to(accelerator.device), batch_latents.shape[-2:])
                step_cfg = {**step_cfg, "loss_mask": grid}
            with accelerator.autocast():
                part = adapter.training_loss(denoiser, batch_latents, text, step_cfg, scheduler, gens)
            accelerator.backward(part * weight)
            part = part.detach() * weight
            loss = loss + (accelerator.reduce(part, reduction="sum") if world > 1 else part)
        if world > 1:  # the batch's gradient: the weighted per-process gradients, summed
            sum_gradients(accelerator, params)
        if tc["max_grad_norm"] > 0:
            accelerator.clip_grad_norm_(params, tc["max_grad_norm"])
        optimizer.step()
        if ema is not None:
            update_ema(ema, named, tc["ema_decay"])
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        step_losses.append(loss.item())
        window.append(step_losses[-1])
        accelerator.log({"loss": step_losses[-1], "lr": lr_schedule.get_last_lr()[0]}, step=step)
        progress.update()
        progress.set_postfix(loss=f"{step_losses[-1]:.4f}", refresh=False)
        if (step % tc["log_every"] == 0 or step == tc["max_steps"]) and main:
            rate = (step - start) / max(time.perf_counter() - t0, 1e-9)
            log.info("train: step %4d/%d  loss %.4f  lr %.2e  %.2f it/s  ETA %s", step, tc["max_steps"],
                     sum(window) / len(window), lr_schedule.get_last_lr()[0], rate,
                     _duration((tc["max_steps"] - step) / rate))
            window = []
        if sampler.due(step) and main:
            sampler(step, denoiser, checkpoint_key(trajectory, step))
        if held and main and validation.due(step, tc["validate_every_n_steps"], tc["max_steps"]):
            value = validation.score(adapter, denoiser, accelerator, held, val_latents, val_texts, tc, scheduler, val_controls)
            val_losses.append({"step": step, "loss": value})
            accelerator.log({"validation_loss": value}, step=step)
            log.info("train: step %4d/%d  validation loss %.4f (%d held-out item(s) x %d fixed draws)", step,
                     tc["max_steps"], value, len(held), validation.DRAWS)
        every, stop = tc["save_every_n_steps"], interrupt.stop_requested()  # stop: Ctrl-C/SIGTERM, at a step's end
        if ((every and step % every == 0) or step == tc["max_steps"] or stop) and main:
            _save_checkpoint(store, checkpoint_key(trajectory, step), step, named, optimizer, step_losses,
                             sampler.rendered, accelerator.scaler, ema, val_losses if held else None)
        if stop:
            interrupt.kept(f"a checkpoint of train step {step}/{tc['max_steps']}")
            raise interrupt.Interrupted(stop)
        accelerator.wait_for_everyone()
    progress.close()
    accelerator.end_training()
    if not main:
        return None
    write = te_lora.writer(adapter, denoiser, encoders)  # with train.text_encoder_lr: the encoders' layers too
    lora = write(out_dir)
    extra = {"lora_ema": str(save_ema(named, ema, lambda: write(out_dir / "ema")))} if ema else {}
    return {"lora": lora, **extra, "step_losses": step_losses, "continued_from_step": start,
            "checkpoint_samples": sampler.rendered, "sample_warnings": sampler.warnings,
            **({"validation_loss": val_losses} if held else {})}


def run(cfg: dict, plan: dict, store: Store, latent_keys: dict, text_keys: dict, run_dir: Path | None = None,
        on_samples: list | None = None) -> dict:
    """The train node: the stored LoRA for this key, or a new one trained in this process or, with
    `train.num_processes` > 1, under `accelerate launch` (tasks/training/distributed.py). `run_dir` receives the
    TensorBoard logs of the steps trained in this run and the samples rendered during training, as they
    are rendered; `on_samples` (in this process only) is told of each sample point."""
    node_inputs = inputs(cfg, plan, latent_keys, text_keys)
    key = key_of(node_inputs)
    status = check_items(store, KIND, [key])
    if status.reused and checkpoint_samples.repair(store, KIND, key, trajectory_key(node_inputs, cfg["train"]),
                                                   cfg["train"]["max_steps"]):
        status.reused, status.missing, status.repaired = [], [key], [key]
    ema = cfg["train"].get("ema_decay") is not None
    if ema and status.reused and not store.valid(EMA_KIND, key):  # made again from the last checkpoint
        status.reused, status.missing, status.repaired = [], [key], [key] if store.exists(EMA_KIND, key) else []
    resumed = None
    if status.missing:
        trajectory = trajectory_key(node_inputs, cfg["train"])
        with store.tmp_dir("train") as tmp:
            if cfg["train"]["num_processes"] > 1 or cfg["train"]["num_machines"] > 1:
                from tasks.training.distributed import launch_training, wait_for_lora

                out = launch_training(cfg, plan, latent_keys, text_keys, Path(tmp), trajectory, run_dir)
                if out is None:  # a machine other than 0: machine 0 stores the LoRA
                    wait_for_lora(store, KIND, key)
            else:
                # a signal stops the loop at the end of its step (checkpoint kept), then is raised again
                out = interrupt.until_safe_point(train_lora, cfg, plan, store, latent_keys, text_keys, Path(tmp),
                                                 trajectory, run_dir, on_samples)
            if out is not None:
                canonicalize_safetensors(out["lora"])  # same config + data -> the same bytes
                ema_file = out.pop("lora_ema", None)
                if ema_file:  # stored before the LoRA: a stored LoRA of an EMA run has its EMA
                    canonicalize_safetensors(Path(ema_file))
                    store.put_file(EMA_KIND, key, ema_file, meta={"lora": key, "ema_decay": cfg["train"]["ema_decay"]})
                store.put_file(KIND, key, out.pop("lora"), meta={**out, "family": plan["family"]})
        resumed = (out or {}).get("continued_from_step") or None
    meta = store.meta(KIND, key)
    return node_result(key, {"lora": key}, status, node_inputs, lora=str(store.get_path(KIND, key)),
                       losses=logged_losses(meta.get("step_losses", []), cfg["train"]["log_every"]),
                       continued_from_step=resumed, checkpoint_samples=meta.get("checkpoint_samples", {}),
                       sample_warnings=meta.get("sample_warnings", []),
                       validation_loss=meta.get("validation_loss", []),
                       **({"lora_ema": str(store.get_path(EMA_KIND, key))} if ema else {}))


if __name__ == "__main__":  # one process of `accelerate launch` (train.num_processes; tasks/training/distributed.py)
    from tasks.training.distributed import run_worker
    run_worker(sys.argv[1], train_lora)
