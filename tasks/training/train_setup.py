"""What the train node sets up before its loop: seeds, accelerate, the optimizer, and the denoiser with its
LoRA and memory options. Separate from the loop so that bench/gpu.py and the tests prepare exactly what
training does."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from tasks.config import Config, stored_as
from tasks.config_schema import TrainConfig
from tasks.lazy import lazy
from tasks.models.lora_variants import lycoris
from tasks.training import w8a8
from tasks.training.base_loading import load_planned, plan_loading
from tasks.training.memory import layerwise_skip_patterns, lora_targets

torch, np = lazy("torch"), lazy("numpy")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def precision(cfg: Config) -> str:
    """accelerate's mixed_precision: fp16 (autocast + GradScaler) whenever the weights are fp16, so the backward
    pass never runs in fp16 without loss scaling (the LoRA weights are fp32); else train.mixed_precision."""
    return "fp16" if cfg.model.dtype == "float16" else cfg.train.mixed_precision


def make_accelerator(mixed_precision: str, log_dir: Path | None = None, wait=None):
    """accelerate's Accelerator for this run's precision, device and processes (under `accelerate launch`
    it joins the process group: gloo on the CPU, nccl on GPUs). Its state is process-wide and refuses a
    different precision once set, so each training run starts it afresh. With `log_dir`, losses go to
    TensorBoard through accelerate's tracker. `wait`: the process group's timeout (a timedelta; None: torch's)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    AcceleratorState._reset_state(True)
    return Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available(),
                       kwargs_handlers=[InitProcessGroupKwargs(timeout=wait)] if wait else None,
                       log_with=[run_tensorboard("loraflow", log_dir)] if log_dir else None,
                       project_dir=str(log_dir) if log_dir else None)


def run_tensorboard(run_name: str, log_dir: Path):
    """accelerate's TensorBoard tracker (<log_dir>/<run_name>), but init_trackers' config goes in as hparams of
    that run: accelerate's add_hparams writes them to a timestamped subfolder, which TensorBoard lists as a second
    run. The run's "loss" is the hparams table's metric."""
    from accelerate.tracking import TensorBoardTracker, on_main_process

    class RunTensorBoard(TensorBoardTracker):
        @on_main_process
        def store_init_configuration(self, values: dict) -> None:
            from torch.utils.tensorboard.summary import hparams

            for summary in hparams(values, {"loss": 0.0}):  # (the value is not written: the metric's name only)
                self.writer._get_file_writer().add_summary(summary)
            self.writer.flush()

    return RunTensorBoard(run_name, str(log_dir))


def make_optimizer(tc: TrainConfig, params: list) -> torch.optim.Optimizer:
    """train.optimizer: adamw (torch), adamw8bit / lion8bit (bitsandbytes, CUDA only), prodigy (prodigyopt: it
    estimates the step size itself, train.lr=1.0 is its usual setting), adafactor (transformers', with a
    fixed train.lr as sd-scripts documents: no relative step, no parameter scaling, no warm-up)."""
    name, lr, wd = tc.optimizer, tc.lr, tc.weight_decay
    if name in ("adamw8bit", "lion8bit"):
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ValueError(f"train.optimizer={name} needs bitsandbytes and a CUDA GPU (pip install "
                             "bitsandbytes); on this machine use train.optimizer=adamw") from e
        make = bnb.optim.AdamW8bit if name == "adamw8bit" else bnb.optim.Lion8bit
        return make(params, lr=lr, weight_decay=wd)
    if name == "prodigy":
        try:
            from prodigyopt import Prodigy
        except ImportError as e:
            raise ValueError("train.optimizer=prodigy needs prodigyopt (pip install prodigyopt); "
                             "or use train.optimizer=adamw") from e
        return Prodigy(params, lr=lr, weight_decay=wd)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, weight_decay=wd, scale_parameter=False, relative_step=False,
                         warmup_init=False)
    return torch.optim.AdamW(params, lr=lr, weight_decay=wd)


def make_ema(tc: TrainConfig, named: dict) -> dict | None:
    """train.ema_decay: the EMA of the LoRA weights, starting at their initial values (None: off)."""
    if tc.ema_decay is None:
        return None
    return {n: p.detach().clone() for n, p in named.items()}


def update_ema(ema: dict, named: dict, decay: float) -> None:
    """After an optimizer step: ema = decay * ema + (1 - decay) * w, for every LoRA weight (fp32, in place)."""
    with torch.no_grad():
        for n, p in named.items():
            ema[n].mul_(decay).add_(p.detach(), alpha=1 - decay)


def prepare_denoiser(adapter, cfg: Config, stream: bool = True):
    """The base denoiser, frozen, with fp32 LoRA layers (peft), optionally an fp8-stored base and gradient
    checkpointing. Returns (denoiser, {name: trainable parameter}). `stream=False`: the base loaded whole by
    from_pretrained and stored low afterwards, as before issue 43 (bench.load's "before" rows; the same result)."""
    from peft import LoraConfig  # here: a no-op run never trains, and peft takes a second to import

    tc = cfg.train
    # cuDNN's fused attention stays off while training: on an H200 (torch 2.11+cu130) its backward failed with an
    # illegal memory access on FLUX.1-dev at 4608 tokens, where flash/memory-efficient attention ran the same
    # step (bench/RESULTS.md, GPU); pytorch#190321 and #134001 give this same mitigation, and #196678 reports
    # NaN gradients from it since torch 2.11. Only CUDA reads the flag.
    torch.backends.cuda.enable_cudnn_sdp(False)
    stored = stored_as(cfg.model)
    skip = layerwise_skip_patterns(adapter.denoiser_cls, cfg.model.storage_modulation) \
        if stored else ()
    # streamed in, each frozen weight stored low as it is read (tasks/training/base_loading.py)
    loading = plan_loading(adapter, cfg, skip) if stream else None
    denoiser = load_planned(adapter, loading, adapter.load_denoiser)
    denoiser.requires_grad_(False)
    alpha = tc.alpha if tc.alpha is not None else tc.rank
    # train.network=dora / train.rslora: peft's own variants; loha / lokr: peft's LoHaConfig / LoKrConfig
    # (tasks/models/lora_variants/lycoris.py). At the defaults the config is the plain LoraConfig it always was, so the
    # file's metadata is unchanged.
    if lycoris.is_lycoris(tc):
        config = lycoris.make_config(tc.network, tc.rank, alpha, lora_targets(tc, adapter))
    else:
        config = LoraConfig(r=tc.rank, lora_alpha=alpha, init_lora_weights="gaussian",
                            target_modules=lora_targets(tc, adapter), use_dora=tc.network == "dora",
                            use_rslora=bool(tc.rslora))
    denoiser.add_adapter(config)
    if tc.network == "lokr":  # the LoKr of Linears that the LyCORIS file fuses share w2 (export_lycoris.fused_groups)
        from tasks.training.export_lycoris import fused_groups

        layers = [n for n, m in denoiser.named_modules() if hasattr(m, "lokr_w1")]
        lycoris.share_w2(denoiser, fused_groups(adapter.family, layers))
    named = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    for p in named.values():  # LoRA weights train in fp32 whatever the base dtype
        p.data = p.data.float()
    if loading is not None:
        loading.attach(denoiser)
    if stored in ("int8", "nf4"):
        # model.quantize: torchao's int8 / NF4 tensors as the frozen weights, dequantized inside the same
        # autograd Function (tasks/training/quantized_base.py); the same layers as the fp8 base. model.matmul=bnb:
        # NF4 in bitsandbytes' format, multiplied by its matmul_4bit (tasks/training/nf4_kernel.py)
        from tasks.training.quantized_base import quantize_base

        quantize_base(denoiser, stored, adapter.dtype, skip, w8a8.resolve(cfg.model))
    elif stored:
        # The frozen base weights stored in fp8, each cast to the compute dtype inside an autograd Function
        # that saves only the fp8 weight (tasks/training/fp8_base.py). Embeddings and norms keep the compute dtype (no
        # fp8 index_select), the AdaLN modulation linears too unless model.storage_modulation. Applied after
        # peft wrapped the layers, so the LoRA layers' initial weights never pass through fp8.
        from tasks.training.fp8_base import store_base_low  # here: it subclasses diffusers' hooks (torch at import)

        store_base_low(denoiser, getattr(torch, stored), adapter.dtype, skip)
    if stored and w8a8.resolve(cfg.model) == "w8a8":  # the stored type's own matmul (tasks/training/w8a8.py)
        from tasks.training.fp8_base import set_matmul

        set_matmul(denoiser, "w8a8")
    if tc.blocks_to_swap:
        from tasks.training.block_swap import swap_blocks

        swap_blocks(denoiser, adapter.swap_blocks, tc.blocks_to_swap, adapter.dtype)
    if tc.gradient_checkpointing and tc.gradient_checkpointing_offload:
        from tasks.training.activation_offload import offloaded_checkpoint

        denoiser.enable_gradient_checkpointing(offloaded_checkpoint)
    elif tc.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    return denoiser, named


def save_ema(named: dict, ema: dict, write: Callable[[], Path]) -> Path:
    """The EMA weights in the plain LoRA's file format: swapped into the LoRA layers while `write` writes them."""
    with torch.no_grad():
        plain = {n: p.detach().clone() for n, p in named.items()}
        try:
            for n, p in named.items():
                p.copy_(ema[n])
            return write()
        finally:
            for n, p in named.items():
                p.copy_(plain[n])


def sum_gradients(accelerator, params: list[torch.Tensor]) -> None:
    """One all-reduce of every LoRA gradient (the LoRA is small; no DDP wrapper, so the adapters keep
    calling the model itself and reading its config)."""
    params = [p for p in params if p.grad is not None]  # SDXL's CLIP-L last layer: unused, no gradient
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    flat = accelerator.reduce(flat, reduction="sum")
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))
