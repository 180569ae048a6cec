"""Node train: a LoRA on the denoiser (peft), trained from cached latents and text only.

The VAE and the text encoders are never loaded here: every batch comes from the store."""
from __future__ import annotations

import copy
import logging
import sys
import time
import warnings
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from tqdm.auto import tqdm

from tasks import cache_latents
from tasks.config import Config, as_plain, stored_as
from tasks.data import masks, video
from tasks.items import Memo as _Memo, check_items, node_result, prefetch
from tasks.lazy import lazy
from tasks.models import make_adapter
from tasks.models.bases import losses
from tasks.models.lora_variants import text_encoder_lora as te_lora
from tasks.plan import Plan
from tasks.store import Store
from tasks.store.hashing import key_of
from tasks.store.stored_files import canonicalize_safetensors
from tasks.training import (batches, checkpoint_samples, checkpoints, interrupt, sharding, validation_loss as validation,
                            w8a8)
# the batch readers and draws (tests and tasks.training.distributed import these names from the node)
from tasks.training.batches import (BatchLoader, Captions, Latents, batch_at, buckets_of,  # noqa: F401
                                    item_generators, my_share)
from tasks.training.checkpoint_samples import CheckpointSampler, to_tensorboard
from tasks.training.compiled_blocks import attention_backend, compile_blocks, matmul_path
from tasks.training.checkpoints import checkpoint_key, latest_checkpoint, load_checkpoint as _load_checkpoint
from tasks.training.checkpoints import save_checkpoint as _save_checkpoint  # tests wrap it to fail after a save
from tasks.training.train_key import CODE_VERSION, inputs, key_of_node, trajectory_key  # noqa: F401 (the node's key, re-exported)
from tasks.training.train_setup import (make_accelerator, make_ema, make_optimizer, precision, prepare_denoiser, save_ema,
                                        seed_everything, sum_gradients, update_ema)

torch = lazy("torch")
optimization = lazy("diffusers.optimization")

KIND = "lora"
CHECKPOINT_KIND = checkpoints.KIND
EMA_KIND = "lora_ema"  # train.ema_decay: the EMA LoRA, under the train key
log = logging.getLogger("loraflow")

def overlap_loading() -> bool:
    """Whether batches are prepared in a thread, one step ahead (with CUDA; the tests force it on the CPU)."""
    return torch.cuda.is_available()


def logged_losses(step_losses: list[float], every: int) -> list[dict]:
    """Mean loss per window of `every` steps (and the last, partial one), as the log prints them."""
    return [{"step": min(i + every, len(step_losses)), "loss": sum(w) / len(w)}
            for i in range(0, len(step_losses), every) if (w := step_losses[i:i + every])]


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


@dataclass
class _Run:
    """What the steps of one training run share, set up by `_set_up`."""
    cfg: Config
    plan: Plan
    store: Store
    adapter: object
    accelerator: object
    denoiser: object
    named: dict  # name -> trainable parameter (the LoRA, and the text encoders' with train.text_encoder_lr)
    encoders: object  # the text encoders being trained, or None
    optimizer: object
    ema: dict | None
    lr_schedule: object
    scheduler: object
    sampler: CheckpointSampler
    texts: Captions
    load: BatchLoader
    held: list[str]  # data.validation_split's items: scored, never drawn
    scoring: tuple | None  # (latents, texts, controls) of the held-out items
    runtime: dict = field(default_factory=dict)  # report runtime.compile / attention / matmul
    start: int = 0  # the step this run continues from
    step_losses: list = field(default_factory=list)
    val_losses: list = field(default_factory=list)
    on_step: list = field(default_factory=list)  # (step, max_steps) after each step, main process

    @property
    def tc(self) -> dict:
        return self.cfg.train

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def train_lora(cfg: Config, plan: Plan, store: Store, latent_keys: dict, text_keys: dict, out_dir: Path,
               trajectory: str, run_dir: Path | None = None, on_samples: list | None = None,
               on_step: list | None = None) -> dict:
    """The training loop, top to bottom. Runs as one process or as each of `train.num_processes` (data
    parallel: every step's batch is split across processes, gradients summed with the loss weights of
    `my_share`). Returns the LoRA file, per-step losses, the step it continued from, and the samples
    rendered during training (the main process's view; the others return None). `run_dir`: TensorBoard
    logs go to its tensorboard/, samples rendered during training to its samples/step_<k>/ as they are
    made; `on_samples`: more callbacks (step, paths) for them (the flow's Prefect artifact); `on_step`:
    callbacks (step, max_steps) after each step (the flow's progress artifact)."""
    run = _set_up(cfg, plan, store, latent_keys, text_keys, run_dir, on_samples)
    run.on_step = on_step or []
    _resume(run, trajectory)
    _train_steps(run, trajectory)
    try:
        return _export(run, out_dir)
    finally:  # after the export: with train.shard=fsdp it gathers the LoRA over the process group this ends
        run.accelerator.end_training()


def _set_up(cfg, plan, store, latent_keys, text_keys, run_dir, on_samples) -> _Run:
    """Data readers, seeds, accelerate, the denoiser with its LoRA, the optimizer and schedules, the sampler."""
    tc = cfg.train
    adapter = make_adapter(cfg.model, plan.model_dir)
    from tasks.training.quantized_base import text_loading

    adapter.text_loading = text_loading(cfg.text)  # captions encoded live: the encoders as cache_text stores them
    names = [it["name"] for it in plan.items]
    latents = Latents(store, [latent_keys[n] for n in names])
    texts = Captions(cfg, plan, store, adapter, text_keys)
    seed = int(tc.seed)
    seed_everything(seed)
    tensorboard = run_dir / "tensorboard" if run_dir and tc.log_with == "tensorboard" else None
    accelerator = make_accelerator(precision(cfg), tensorboard, sharding.WAIT if sharding.sharded(cfg) else None)
    if sharding.sharded(cfg):  # train.shard=fsdp: each process loads the base in turn and keeps its shard
        denoiser, named, shard = sharding.load_sharded(accelerator, lambda: prepare_denoiser(adapter, cfg)[0],
                                                       adapter, tc.shard_offload)
    else:
        (denoiser, named), shard = prepare_denoiser(adapter, cfg), None
        denoiser.to(accelerator.device)
    encoders = texts.trained  # train.text_encoder_lr: LoRA'd after the denoiser (its initial weights as without)
    named, groups = te_lora.add_to_training(adapter, encoders, tc, named)
    runtime = kernels(cfg, adapter, denoiser)
    if shard:
        runtime["shard"] = shard
    optimizer = accelerator.prepare_optimizer(make_optimizer(tc, groups))
    ema = make_ema(tc, named)  # train.ema_decay (None: off)
    lr_schedule = optimization.get_scheduler(tc.lr_scheduler, optimizer, num_warmup_steps=tc.warmup_steps,
                                             num_training_steps=tc.max_steps)
    scheduler = adapter.load_train_scheduler()
    sampler = CheckpointSampler(cfg, plan, store, adapter, run_dir / "samples" if run_dir else None,
                                [to_tensorboard(accelerator), *(on_samples or [])],
                                live_text=None if encoders is None else te_lora.live_prompts(adapter, encoders))
    held = plan.validation_items
    scoring = _held_out(plan, store, latent_keys, texts, held) if held else None
    repeats = [0 if it["name"] in held else it.get("repeats", 1) for it in plan.items]
    buckets = buckets_of(latents.shapes, repeats)
    load = BatchLoader(store, plan.items, latent_keys, latents, texts, buckets,
                       min(tc.batch_size, sum(repeats)),  # an epoch draws sum(repeats) items
                       seed, accelerator.process_index, accelerator.num_processes, tc.gradient_accumulation_steps,
                       tc.prior_loss_weight)
    return _Run(cfg, plan, store, adapter, accelerator, denoiser, named, encoders, optimizer, ema, lr_schedule,
                scheduler, sampler, texts, load, held, scoring, runtime)


def kernels(cfg: Config, adapter, denoiser) -> dict:
    """train.compile (the blocks compiled here, after every memory option is in place) and the kernel paths the
    report names (tasks/training/compiled_blocks.py)."""
    compiled = compile_blocks(denoiser, adapter.swap_blocks) if cfg.train.compile else 0
    return {"compile": {"enabled": bool(compiled), "blocks": compiled}, "attention": attention_backend(),
            "matmul": matmul_path(stored_as(cfg.model), str(adapter.dtype).replace("torch.", ""),
                                  w8a8.resolve(cfg.model))}


def _held_out(plan: Plan, store: Store, latent_keys: dict, texts: Captions, held: list[str]) -> tuple:
    """The held-out items' readers: their own memos (the loader thread has its own), the same encoders."""
    val_latents = Latents(store, [latent_keys[n] for n in held])
    by_name = {it["name"]: it for it in plan.items}
    val_texts = copy.copy(texts)  # fresh draws, its own memo
    val_texts.items, val_texts.memo = [by_name[n] for n in held], _Memo(batches.MEMO_ITEMS)
    control_keys = BatchLoader.control_keys_of(plan.items, latent_keys)
    return val_latents, val_texts, validation.held_controls(store, cache_latents.KIND, plan.items, control_keys,
                                                            held)


def _resume(run: _Run, trajectory: str) -> None:
    """train.resume=auto: the latest stored checkpoint of this trajectory, its losses, samples and schedule."""
    tc = run.tc
    if tc.resume == "auto":  # only the main process discards a corrupt checkpoint; the others skip it
        run.start = latest_checkpoint(run.store, trajectory, tc.max_steps, discard=run.main)
    if not run.start:
        return
    start = run.start
    restored = _load_checkpoint(run.store, checkpoint_key(trajectory, start), run.named, run.optimizer,
                                run.accelerator.scaler, run.ema)
    run.step_losses = list(restored["losses"])
    run.val_losses = [v for v in restored.get("validation_loss", []) if v["step"] <= start]
    run.sampler.rendered = {k: v for k, v in restored.get("samples", {}).items() if run.sampler.due(int(k))}
    with warnings.catch_warnings():  # stepping the schedule to where it was, without optimizer steps
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(start):
            run.lr_schedule.step()
    log.info("train: continuing from the stored checkpoint at step %d (steps %d-%d to go)",
             start, start + 1, tc.max_steps)


def _announce(run: _Run) -> None:
    tc, accelerator, world = run.tc, run.accelerator, run.accelerator.num_processes
    if run.main:
        log.info("train: %d steps, %d images, batch %d%s, rank %d, lr %g%s, %d trainable parameters",
                 tc.max_steps, len(run.plan.items) - len(run.held), tc.batch_size,
                 f" over {world} processes" if world > 1 else "", tc.rank, tc.lr,
                 "" if run.encoders is None else f" (text encoders: {tc.text_encoder_lr:g})",
                 sum(p.numel() for p in run.named.values()))
        accelerator.init_trackers("loraflow", config={k: v for k, v in as_plain(tc).items() if isinstance(v, (int, float, str, bool))})
    groups = run.load.groups
    if len(groups) > 1 and run.main:
        log.info("train: %d buckets, each batch from one: %s", len(groups),
                 ", ".join(f"{video.bucket_name(run.plan.items[g[0]], run.plan.size)}: {len(g)}" for g in groups))


def _train_steps(run: _Run, trajectory: str) -> None:
    """Steps start+1 .. max_steps: each an optimizer step over train.gradient_accumulation_steps micro-batches,
    then what falls due after it (logs, samples, the validation loss, a checkpoint, a requested stop)."""
    tc = run.tc
    run.denoiser.train()
    _announce(run)
    progress = tqdm(total=tc.max_steps, initial=run.start, desc="train", unit="step",
                    disable=None if run.main else True)
    steps = list(range(run.start + 1, tc.max_steps + 1))
    accum = tc.gradient_accumulation_steps
    # With CUDA the next step's batch is read and pinned while the GPU trains on this one. On the CPU a
    # loader thread only contends with the step's own threads (measured: 1.5x the step time on 2 cores).
    # Trained encoders encode in the step itself (lazily, by map), after the previous optimizer step.
    micro = [(s - 1) * accum + m for s in steps for m in range(1, accum + 1)]
    ahead = overlap_loading() and run.encoders is None
    batches = iter(prefetch(run.load, micro) if ahead else map(run.load, micro))
    clock = {"t0": time.perf_counter(), "window": []}
    seconds = []  # each step's wall time: the first holds the compile (runtime.compile)
    for step in steps:
        t = time.perf_counter()
        loss = _optimizer_step(run, islice(batches, accum), accum)
        run.step_losses.append(loss.item())
        seconds.append(time.perf_counter() - t)
        progress.update()
        progress.set_postfix(loss=f"{run.step_losses[-1]:.4f}", refresh=False)
        _after_step(run, step, trajectory, clock)
    progress.close()
    if len(seconds) > 1:  # compile time ~ the first step beyond a steady one (the first step's own warm-up too)
        steady = sorted(seconds[1:])[len(seconds[1:]) // 2]
        run.runtime["compile"].update(first_step_s=seconds[0], step_median_s=steady,
                                      seconds=max(0.0, seconds[0] - steady) if run.runtime["compile"]["enabled"] else 0.0)


def _optimizer_step(run: _Run, batches, accum: int):
    """One optimizer step: the micro-batches' gradients added up (and summed over processes), clipped, applied.
    Returns the step's loss: the mean over its micro-batches and processes."""
    tc, accelerator, adapter = run.tc, run.accelerator, run.adapter
    world, params = accelerator.num_processes, list(run.named.values())
    loss = 0.0
    for batch in batches:  # gradients add up; checkpoints fall between optimizer steps
        weight, gens = batch.weight / accum, batch.generators
        batch_latents = batch.latents.to(accelerator.device, adapter.dtype, non_blocking=True)
        text = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.text.items()}
        # reg images' weights reach the loss through the train config (tasks/models/bases/losses.py: item_weights)
        # and the masks, on the latent grid (tasks/models/bases/losses.py: masked)
        grid = None if batch.loss_mask is None else \
            masks.on_latent_grid(batch.loss_mask.to(accelerator.device), batch_latents.shape[-2:])
        step_cfg = losses.for_batch(tc, batch.item_weights, grid)
        with accelerator.autocast():
            part = adapter.training_loss(run.denoiser, batch_latents, text, step_cfg, run.scheduler, gens)
        accelerator.backward(part * weight)
        part = part.detach() * weight
        loss = loss + (accelerator.reduce(part, reduction="sum") if world > 1 else part)
    if world > 1 and "shard" not in run.runtime:  # the batch's gradient: the weighted per-process gradients,
        sum_gradients(accelerator, params)  # summed (train.shard=fsdp: FSDP2 sums them in backward)
    if tc.max_grad_norm > 0:
        accelerator.clip_grad_norm_(params, tc.max_grad_norm)
    run.optimizer.step()
    if run.ema is not None:
        update_ema(run.ema, run.named, tc.ema_decay)
    run.lr_schedule.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss


def _after_step(run: _Run, step: int, trajectory: str, clock: dict) -> None:
    """What falls due after an optimizer step: the log line, samples, the validation loss, a checkpoint, a stop."""
    tc, accelerator, main = run.tc, run.accelerator, run.main
    everyone = "shard" in run.runtime  # train.shard=fsdp: what runs the denoiser or gathers runs on every process
    clock["window"].append(run.step_losses[-1])
    accelerator.log({"loss": run.step_losses[-1], "lr": run.lr_schedule.get_last_lr()[0]}, step=step)
    if (step % tc.log_every == 0 or step == tc.max_steps) and main:
        rate = (step - run.start) / max(time.perf_counter() - clock["t0"], 1e-9)
        window = clock["window"]
        log.info("train: step %4d/%d  loss %.4f (mean of %d steps)  lr %.2e  %.2f it/s  ETA %s", step, tc.max_steps,
                 sum(window) / len(window), len(window), run.lr_schedule.get_last_lr()[0], rate,
                 _duration((tc.max_steps - step) / rate))
        clock["window"] = []
    for tell in run.on_step if main else ():
        tell(step, tc.max_steps)
    if run.sampler.due(step) and main:
        run.sampler(step, run.denoiser, checkpoint_key(trajectory, step))
    if run.held and (main or everyone) and validation.due(step, tc.validate_every_n_steps, tc.max_steps):
        value = validation.score(run.adapter, run.denoiser, accelerator, run.held, *run.scoring[:2], tc,
                                 run.scheduler, run.scoring[2])
        run.val_losses.append({"step": step, "loss": value})
        accelerator.log({"validation_loss": value}, step=step)
        if main:
            log.info("train: step %4d/%d  validation loss %.4f (%d held-out item(s) x %d fixed draws)", step,
                 tc.max_steps, value, len(run.held), validation.DRAWS)
    every, stop = tc.save_every_n_steps, interrupt.stop_requested()  # stop: Ctrl-C/SIGTERM, at a step's end
    if accelerator.num_processes > 1:  # every process stops after the same step (a sharded checkpoint's gather is
        stop = sharding.agreed(stop, accelerator.device)  # collective; data parallel's next step would wait forever)
    if ((every and step % every == 0) or step == tc.max_steps or stop) and (main or everyone):
        _save_checkpoint(run.store, checkpoint_key(trajectory, step), step, run.named, run.optimizer,
                         run.step_losses, run.sampler.rendered, accelerator.scaler, run.ema,
                         run.val_losses if run.held else None, write=main)
    if stop:
        interrupt.kept(f"a checkpoint of train step {step}/{tc.max_steps}")
        raise interrupt.Interrupted(stop)
    accelerator.wait_for_everyone()


def _export(run: _Run, out_dir: Path) -> dict | None:
    """The LoRA file (and the EMA's) from the main process, with what the node stores beside it."""
    if "shard" in run.runtime:  # gathered from every process's shard (collective), written by the main one
        holder = run.adapter.lora_holder(run.denoiser)
        states = [sharding.full_lora_state(holder), *([sharding.full_lora_state(holder, run.ema)] if run.ema else [])]
        if not run.main:
            return None
        lora = te_lora.writer(run.adapter, run.denoiser, None, states[0])(out_dir)
        extra = {"lora_ema": str(te_lora.writer(run.adapter, run.denoiser, None, states[1])(out_dir / "ema"))} \
            if run.ema else {}
    elif not run.main:
        return None
    else:
        write = te_lora.writer(run.adapter, run.denoiser, run.encoders)  # train.text_encoder_lr: the encoders' too
        lora = write(out_dir)
        extra = {"lora_ema": str(save_ema(run.named, run.ema, lambda: write(out_dir / "ema")))} if run.ema else {}
    return {"lora": lora, **extra, "step_losses": run.step_losses, "continued_from_step": run.start,
            "runtime": run.runtime,
            "checkpoint_samples": run.sampler.rendered, "sample_warnings": run.sampler.warnings,
            **({"validation_loss": run.val_losses} if run.held else {})}


def run(cfg: Config, plan: Plan, store: Store, latent_keys: dict, text_keys: dict, run_dir: Path | None = None,
        on_samples: list | None = None, on_step: list | None = None) -> dict:
    """The train node: the stored LoRA for this key, or a new one trained in this process or, with
    `train.num_processes` > 1, under `accelerate launch` (tasks/training/distributed.py). `run_dir` receives the
    TensorBoard logs of the steps trained in this run and the samples rendered during training, as they
    are rendered; `on_samples` (in this process only) is told of each sample point, `on_step` of each step."""
    node_inputs = inputs(cfg, plan, latent_keys, text_keys)
    key = key_of(node_inputs)
    status = check_items(store, KIND, [key])
    if status.reused and checkpoint_samples.repair(store, KIND, key, trajectory_key(node_inputs, cfg.train),
                                                   cfg.train.max_steps):
        status.reused, status.missing, status.repaired = [], [key], [key]
    ema = cfg.train.ema_decay is not None
    if ema and status.reused and not store.valid(EMA_KIND, key):  # made again from the last checkpoint
        status.reused, status.missing, status.repaired = [], [key], [key] if store.exists(EMA_KIND, key) else []
    resumed = None
    if status.missing:
        trajectory = trajectory_key(node_inputs, cfg.train)
        with store.tmp_dir("train") as tmp:
            if cfg.train.num_processes > 1 or cfg.train.num_machines > 1:
                from tasks.training.distributed import launch_training, wait_for_lora

                # a signal asks every process to stop after the same step (checkpoint kept), then is raised again
                out = interrupt.until_safe_point(launch_training, cfg, plan, latent_keys, text_keys, Path(tmp),
                                                 trajectory, run_dir, on_step)
                if out is None:  # a machine other than 0: machine 0 stores the LoRA
                    wait_for_lora(store, KIND, key)
            else:
                # a signal stops the loop at the end of its step (checkpoint kept), then is raised again
                out = interrupt.until_safe_point(train_lora, cfg, plan, store, latent_keys, text_keys, Path(tmp),
                                                 trajectory, run_dir, on_samples, on_step)
            if out is not None:
                canonicalize_safetensors(out["lora"])  # same config + data -> the same bytes
                ema_file = out.pop("lora_ema", None)
                if ema_file:  # stored before the LoRA: a stored LoRA of an EMA run has its EMA
                    canonicalize_safetensors(Path(ema_file))
                    store.put_file(EMA_KIND, key, ema_file, meta={"lora": key, "ema_decay": cfg.train.ema_decay})
                store.put_file(KIND, key, out.pop("lora"), meta={**out, "family": plan.family})
        resumed = (out or {}).get("continued_from_step") or None
    meta = store.meta(KIND, key)
    return node_result(key, {"lora": key}, status, node_inputs, lora=str(store.get_path(KIND, key)),
                       losses=logged_losses(meta.get("step_losses", []), cfg.train.log_every),
                       step_losses=meta.get("step_losses", []),  # <run dir>/loss.png
                       continued_from_step=resumed, checkpoint_samples=meta.get("checkpoint_samples", {}),
                       sample_warnings=meta.get("sample_warnings", []),
                       validation_loss=meta.get("validation_loss", []), runtime=meta.get("runtime", {}),
                       **({"lora_ema": str(store.get_path(EMA_KIND, key))} if ema else {}))


if __name__ == "__main__":  # one process of `accelerate launch` (train.num_processes; tasks/training/distributed.py)
    from tasks.lazy import settle
    from tasks.training.distributed import run_worker

    settle("diffusers")  # it trains: the model libraries imported with the collector paused (tasks/lazy.py)
    run_worker(sys.argv[1], train_lora)
