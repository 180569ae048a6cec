"""FLUX.1-dev LoRA training as the train node does it, at any size: the architecture (FLUX_DEV, TINY), the
denoiser prepared by the node's own prepare_denoiser with random weights (build), the cached inputs of one
batch (inputs), one step (train_step) and a timed run of one setting (run_config). Shared by bench.gpu, its
units and bare loops, and bench.memory; imports none of them."""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from tasks.config import config_of
from tasks.config_schema import TrainConfig

HERE = Path(__file__).resolve().parent
GIB = 1 << 30

# FLUX.1-dev transformer/config.json
from tasks.models.flux import FLUX1_DEV as FLUX_DEV  # noqa: E402 (FLUX.1-dev's config, declared by the family)
TINY = dict(FLUX_DEV, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
# (name, fp8 base, gradient checkpointing, modulation linears in fp8 too)
CONFIGS = (("bf16", False, False, False), ("bf16+ckpt", False, True, False), ("fp8+ckpt", True, True, False),
           ("fp8-all+ckpt", True, True, True))
LABELS = {"bf16": "bf16, no checkpointing", "bf16+ckpt": "bf16 + gradient checkpointing",
          "fp8+ckpt": "fp8 base + gradient checkpointing",
          "fp8-all+ckpt": "fp8 base incl. modulation + gradient checkpointing"}
# The train node's flow-matching settings (conf/train defaults; tasks/config.py TrainConfig).
TRAIN_SETTINGS = dict(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, guidance=1.0,
                      optimizer="adamw", lr=1e-4, weight_decay=0.0, max_grad_norm=1.0)
TRAIN_CFG = TrainConfig(**TRAIN_SETTINGS)
def random_model(cls, arch: dict, device):
    """`cls(**arch)` with random bf16 weights made on `device` (meta: shapes only): no file, no fp32 copy anywhere."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return cls(**arch)
    finally:
        torch.set_default_dtype(previous)


def build(arch: dict, device, fp8: bool, ckpt: bool, rank: int, modulation: bool = False):
    """(adapter, denoiser, LoRA parameters), prepared by the train node's own code."""
    from diffusers import FluxTransformer2DModel

    from tasks.models.flux import FluxAdapter
    from tasks.training.train_setup import prepare_denoiser

    class RandomFlux(FluxAdapter):
        def load_denoiser(self):
            return random_model(FluxTransformer2DModel, arch, device)

    adapter = RandomFlux(HERE, "bfloat16")  # (no model folder is read)
    cfg = config_of({"model": {"storage_dtype": "float8_e4m3fn" if fp8 else None, "storage_modulation": modulation},
                     "train": {"rank": rank, "alpha": None, "target_modules": None, "gradient_checkpointing": ckpt}})
    denoiser, named = prepare_denoiser(adapter, cfg)
    denoiser.train()
    return adapter, denoiser, list(named.values())


def train_step(adapter, model, params, opt, scheduler, latents, text, generators):
    """One step as the train node takes it under train.mixed_precision=bf16: the adapter's loss, backward,
    gradient clipping, the optimizer. Returns the loss."""
    import torch

    with torch.autocast(latents.device.type, dtype=torch.bfloat16):
        loss = adapter.training_loss(model, latents, text, TRAIN_CFG, scheduler, generators)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, TRAIN_CFG.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def inputs(arch: dict, resolution: int, text_len: int, batch: int, device):
    """Cached latents and text of one batch, as the train node reads them from the store."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    latent = resolution // 8  # the VAE's factor; the adapter packs 2x2
    return rnd(batch, arch["in_channels"] // 4, latent, latent), {
        "prompt_embeds": rnd(batch, text_len, arch["joint_attention_dim"]),  # T5 states
        "pooled_prompt_embeds": rnd(batch, arch["pooled_projection_dim"]),  # CLIP pooled
    }


def run_config(name: str, fp8: bool, ckpt: bool, modulation: bool, args, arch: dict, device) -> dict:
    import torch

    cuda = device.type == "cuda"
    out = {"config": name, "fp8": fp8, "checkpointing": ckpt, "modulation_fp8": modulation, "oom": False, "error": None, "step_s": [],
           "peak_gib": None, "weights_gib": None, "build_peak_gib": None}
    model = params = opt = latents = text = None
    try:
        from diffusers import FlowMatchEulerDiscreteScheduler

        from tasks.training.train_setup import make_optimizer

        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        adapter, model, params = build(arch, device, fp8, ckpt, args.rank, modulation)
        out["build_s"] = time.perf_counter() - t
        out["params"] = sum(p.numel() for p in model.parameters())
        out["lora_params"] = sum(p.numel() for p in params)
        out["weightbytes_by_dtype"] = bytes_by_dtype(model)
        latents, text = inputs(arch, args.resolution, args.text_len, args.batch, device)
        opt = make_optimizer(TRAIN_CFG, params)
        scheduler = FlowMatchEulerDiscreteScheduler()  # training reads only its sigmas and timesteps
        if cuda:
            torch.cuda.synchronize()
            out["build_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            out["weights_gib"] = torch.cuda.memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
        for step in range(args.warmup + args.steps):
            t = time.perf_counter()
            generators = [torch.Generator().manual_seed(step * args.batch + j) for j in range(args.batch)]
            loss = train_step(adapter, model, params, opt, scheduler, latents, text, generators)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if step >= args.warmup:
                out["step_s"].append(dt)
            print(f"  {name}: step {step + 1}/{args.warmup + args.steps} {dt:.3f} s loss {loss.item():.4g}", flush=True)
            del loss
    except torch.cuda.OutOfMemoryError as e:
        out["oom"] = True
        out["error"] = str(e).splitlines()[0]
    except Exception as e:  # recorded; the next configuration still runs
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
    finally:
        del model, params, opt, latents, text
        gc.collect()
        if cuda:
            try:  # after a CUDA error the context is gone: keep the error recorded above
                out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                out["error"] = out["error"] or f"{type(e).__name__}: {e}"
    out["step_median_s"] = statistics.median(out["step_s"]) if out["step_s"] else None
    return out


def bytes_by_dtype(model) -> dict:
    sizes: dict = {}
    for p in model.parameters():
        key = str(p.dtype).replace("torch.", "")
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
    return {k: round(v / GIB, 4) for k, v in sizes.items()}
