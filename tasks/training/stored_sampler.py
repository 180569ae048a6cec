"""The sample node's pipeline at the card's size (issue 61): the denoiser(s) streamed in and stored as training
stored them (`model.quantize` / `model.storage_dtype`: the train node's loading plan, base_loading.py, the same
layers and skip patterns), the LoRA file loaded by the family's own loader onto the compute-dtype placeholders,
then the stored weights attached and fp8_base's / quantized_base's hooks registered, in the order
train_setup.prepare_denoiser applies them: the LoRA's layers never pass through the stored type. With
`sample.offload` every block's weights are read straight to the host and swapped in per use, the next block
prefetched on a side stream: the train node's block swap (block_swap.py) with all blocks, which carries torchao's
NF4 tensors (diffusers' group offloading does not: it moves a non-TorchAOBaseTensor subclass's wrapper only).
The text encoders are never loaded (cached prompts).

Without either setting the family's load_sampler runs as before (from_pretrained in model.dtype)."""
from __future__ import annotations

from pathlib import Path

from tasks.config import Config, stored_as
from tasks.lazy import lazy
from tasks.training import w8a8
from tasks.training.base_loading import WeightLoading, load_planned
from tasks.training.memory import layerwise_skip_patterns

torch = lazy("torch")


def stored_key(cfg: Config) -> dict:
    """What the sample node's images depend on beyond today's key: how the base was stored ({} when it is not)."""
    stored = stored_as(cfg.model)
    return {"stored_as": stored, "matmul": w8a8.resolve(cfg.model)} if stored else {}


def load_stored_sampler(adapter, cfg: Config, lora_file: Path | None, **kwargs):
    """adapter.load_sampler(lora_file, **kwargs), its denoisers stored as the run's model.quantize (module doc)."""
    stored, offload = stored_as(cfg.model), bool(cfg.sample.offload)
    if not stored and not offload:
        return adapter.load_sampler(lora_file, **kwargs)
    skip = layerwise_skip_patterns(adapter.denoiser_cls, cfg.model.storage_modulation) if stored else ()
    matmul = w8a8.resolve(cfg.model)
    # DoRA's magnitude reads the base weight when its layer is made: the base loads whole, stored afterwards
    plan = None if stored and cfg.train.network == "dora" else WeightLoading(stored or None, skip, str(adapter.device), matmul)
    if plan is not None and offload:  # every block's weights read straight to the host
        plan.swapped = {sub: _block_prefixes(adapter, sub) for sub in adapter.sample_denoisers()}
    parts = {sub: load_planned(adapter, plan, lambda sub=sub: adapter.pretrained_denoiser(adapter.denoiser_cls, sub))
             for sub in adapter.sample_denoisers()}
    adapter.sampler_parts = parts
    try:
        pipe = adapter.load_sampler(lora_file, **kwargs)  # places the pipeline: swapped weights stay on the host
    finally:
        adapter.sampler_parts = {}
    torch.nn.ModuleList(parts.values()).requires_grad_(False)
    if plan is not None:
        plan.attach(torch.nn.ModuleList(parts.values()))
    for part in parts.values():
        store_like_training(part, stored, adapter.dtype, skip, matmul)
        if offload:
            from tasks.training.block_swap import blocks, swap_blocks

            swap_blocks(part, adapter.swap_blocks, len(blocks(part, adapter.swap_blocks)), adapter.dtype)
            part.to(adapter.device)  # what is not swapped (embedders, final layers); no-op where placed
    return pipe


def _block_prefixes(adapter, subfolder: str) -> tuple[str, ...]:
    from tasks.models.loading.stream_load import folder_entries
    from tasks.training.memory import block_order

    shapes = {k: e.shape for k, e in folder_entries(adapter.model_dir / subfolder).items()}
    return tuple(f"{name}.{i}." for name, i in block_order(shapes, adapter.swap_blocks))


def store_like_training(part, stored: str | None, dtype, skip: tuple, matmul: str) -> None:
    """The hooks train_setup.prepare_denoiser registers on a stored base (its weights attached or still in dtype)."""
    if stored in ("int8", "nf4"):
        from tasks.training.quantized_base import quantize_base

        quantize_base(part, stored, dtype, skip, matmul)
    elif stored:
        from tasks.training.fp8_base import store_base_low

        store_base_low(part, getattr(torch, stored), dtype, skip)
    if stored and matmul == "w8a8":
        from tasks.training.fp8_base import set_matmul

        set_matmul(part, "w8a8")
