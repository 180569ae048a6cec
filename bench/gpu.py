"""Full-size FLUX.1-dev LoRA training on one GPU: step time and peak VRAM for three memory settings.

    python -m bench.gpu              # needs CUDA; writes bench/gpu_results.json and prints a table
    python -m bench.gpu --tiny       # a shrunken config, 1 step, on the CPU if there is no GPU (smoke test)

The transformer is FluxTransformer2DModel with FLUX.1-dev's config (19 double + 38 single blocks, 24 heads x 128
= 3072 wide, T5 width 4096, CLIP pooled 768, guidance_embeds=True, ~11.9 B parameters), built with random bf16
weights directly on the GPU (nothing is downloaded). peft LoRA rank 16 (alpha 16) on the attention projections,
LoRA weights in fp32 (as loraflow's train node), AdamW, bf16 autocast. One 1024x1024 image per step: latents
16x128x128 packed 2x2 into 4096 tokens of 64 channels; the text is cached: random T5 embeddings 512x4096 and a
pooled CLIP vector of 768.

Configurations, each in its own try/except (an OOM is recorded, not fatal):
  bf16            bf16 base, no gradient checkpointing
  bf16+ckpt       bf16 base, gradient checkpointing (diffusers' enable_gradient_checkpointing)
  fp8+ckpt        fp8 e4m3 storage / bf16 compute (diffusers' enable_layerwise_casting) for every Linear except
                  embeddings, norms (incl. the AdaLN modulation linears, diffusers' default for Flux), the final
                  proj_out and the LoRA layers; gradient checkpointing
Peak VRAM is torch.cuda.max_memory_allocated over the training steps (after building the model, whose own
transient peak is reported separately); goals: <= 24 GiB with checkpointing, fp8+checkpointing aims for 16 GiB.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30

# FLUX.1-dev transformer/config.json
FLUX_DEV = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56))
TINY = dict(FLUX_DEV, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
ATTN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
# Kept in bf16 under fp8 storage: embeddings, norms (Flux's _skip_layerwise_casting_patterns plus diffusers'
# defaults), the final projection and the LoRA layers (user-given patterns replace diffusers' automatic peft skip).
FP8_SKIP = ("pos_embed", "norm", "x_embedder", "context_embedder", "time_text_embed", "^proj_out$",
            "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
CONFIGS = (("bf16", False, False), ("bf16+ckpt", False, True), ("fp8+ckpt", True, True))


def build(arch: dict, device, fp8: bool, ckpt: bool, rank: int):
    import torch
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # random bf16 weights created on the device: no fp32 copy anywhere
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(**arch)
    finally:
        torch.set_default_dtype(previous)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=ATTN_TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # fp32 LoRA master weights; compute runs in bf16 under autocast
    if fp8:
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                                       skip_modules_pattern=FP8_SKIP)
    if ckpt:
        model.enable_gradient_checkpointing()
    model.train()
    return model, params


def inputs(arch: dict, resolution: int, text_len: int, batch: int, device):
    import torch
    from diffusers import FluxPipeline

    latent = resolution // 8  # VAE factor 8, then 2x2 packing
    channels = arch["in_channels"] // 4
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    tokens = (latent // 2) ** 2
    return {
        "hidden_states": rnd(batch, tokens, channels * 4),
        "encoder_hidden_states": rnd(batch, text_len, arch["joint_attention_dim"]),  # cached T5 output
        "pooled_projections": rnd(batch, arch["pooled_projection_dim"]),  # cached CLIP pooled output
        "timestep": torch.rand(batch, generator=g).to(device),
        "guidance": torch.full((batch,), 1.0, device=device),
        "img_ids": FluxPipeline._prepare_latent_image_ids(batch, latent // 2, latent // 2, device, torch.bfloat16),
        "txt_ids": torch.zeros(text_len, 3, device=device, dtype=torch.bfloat16),
    }, rnd(batch, tokens, channels * 4)


def run_config(name: str, fp8: bool, ckpt: bool, args, arch: dict, device) -> dict:
    import torch

    cuda = device.type == "cuda"
    out = {"config": name, "fp8": fp8, "checkpointing": ckpt, "oom": False, "error": None, "step_s": [],
           "peak_gib": None, "weights_gib": None, "build_peak_gib": None}
    model = params = opt = batch = target = None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        model, params = build(arch, device, fp8, ckpt, args.rank)
        out["build_s"] = time.perf_counter() - t
        out["params"] = sum(p.numel() for p in model.parameters())
        out["lora_params"] = sum(p.numel() for p in params)
        out["weight_bytes_by_dtype"] = _bytes_by_dtype(model)
        batch, target = inputs(arch, args.resolution, args.text_len, args.batch, device)
        opt = torch.optim.AdamW(params, lr=1e-4)
        if cuda:
            torch.cuda.synchronize()
            out["build_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            out["weights_gib"] = torch.cuda.memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
        for step in range(args.warmup + args.steps):
            t = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                pred = model(**batch, return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), target.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if step >= args.warmup:
                out["step_s"].append(dt)
            print(f"  {name}: step {step + 1}/{args.warmup + args.steps} {dt:.3f} s loss {loss.item():.4g}", flush=True)
            del pred, loss
    except torch.cuda.OutOfMemoryError as e:
        out["oom"] = True
        out["error"] = str(e).splitlines()[0]
    except Exception as e:  # recorded; the next configuration still runs
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if cuda:
            out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        del model, params, opt, batch, target
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    out["step_median_s"] = statistics.median(out["step_s"]) if out["step_s"] else None
    return out


def _bytes_by_dtype(model) -> dict:
    sizes: dict = {}
    for p in model.parameters():
        key = str(p.dtype).replace("torch.", "")
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
    return {k: round(v / GIB, 4) for k, v in sizes.items()}


def figures(results: list[dict]) -> list[dict]:
    def fig(name, value, unit, goal, meets):
        return {"name": name, "value": float("nan") if value is None else float(value), "unit": unit, "goal": goal,
                "meets": bool(meets)}

    figs = []
    for r in results:
        ok = r["error"] is None
        label = {"bf16": "bf16, no checkpointing", "bf16+ckpt": "bf16 + gradient checkpointing",
                 "fp8+ckpt": "fp8 base + gradient checkpointing"}[r["config"]]
        state = "" if ok else (" (OOM)" if r["oom"] else " (error)")
        peak = r["peak_gib"]
        if r["config"] == "bf16":
            figs.append(fig(f"{label}: peak VRAM{state}", peak, "GiB", "reference: fits in GPU memory", ok))
        else:
            figs.append(fig(f"{label}: peak VRAM{state}", peak, "GiB", "<= 24", ok and peak is not None and peak <= 24))
        if r["config"] == "fp8+ckpt":
            figs.append(fig(f"{label}: peak VRAM vs the 16 GiB aim{state}", peak, "GiB", "<= 16 (aim)",
                            ok and peak is not None and peak <= 16))
        figs.append(fig(f"{label}: step time{state}", r["step_median_s"], "s", "reference (median step)", ok))
    return figs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="shrunken config, 1 step, CPU if no GPU (smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per config (default 5; --tiny 1)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 2; --tiny 0)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default 1024; --tiny 128)")
    ap.add_argument("--text-len", type=int, default=None, help="T5 tokens (default 512; --tiny 16)")
    ap.add_argument("--only", default=",".join(c[0] for c in CONFIGS), help="comma list of " +
                    ", ".join(c[0] for c in CONFIGS))
    ap.add_argument("--out", default=None, help="default bench/gpu_results.json (--tiny: bench/gpu_results_tiny.json)")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.tiny:
        print("bench/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False "
              f"(torch {torch.__version__}). Run it on a GPU machine with a CUDA build of torch, or use --tiny to "
              "smoke-test the model construction and one training step on the CPU.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arch = TINY if args.tiny else FLUX_DEV
    args.steps = args.steps if args.steps is not None else (1 if args.tiny else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 2)
    args.resolution = args.resolution or (128 if args.tiny else 1024)
    args.text_len = args.text_len or (16 if args.tiny else 512)
    out_path = Path(args.out or HERE / ("gpu_results_tiny.json" if args.tiny else "gpu_results.json"))
    wanted = set(args.only.split(","))

    device_name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    total_gib = torch.cuda.get_device_properties(0).total_memory / GIB if device.type == "cuda" else None
    print(f"bench.gpu: {'TINY ' if args.tiny else ''}Flux transformer on {device_name}"
          f"{f' ({total_gib:.0f} GiB)' if total_gib else ''}, {args.resolution}px "
          f"({(args.resolution // 16) ** 2} image tokens), text {args.text_len} tokens, batch {args.batch}, "
          f"LoRA rank {args.rank}", flush=True)
    t0 = time.perf_counter()
    results = []
    for name, fp8, ckpt in CONFIGS:
        if name in wanted:
            print(f"{name} ...", flush=True)
            results.append(run_config(name, fp8, ckpt, args, arch, device))
    figs = figures(results)
    doc = {"figures": figs, "machine": {"device": device_name, "total_gib": total_gib, "torch": torch.__version__,
                                        "cuda": torch.version.cuda},
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "config": {"tiny": args.tiny, "arch": arch, "resolution": args.resolution, "text_len": args.text_len,
                      "batch": args.batch, "rank": args.rank, "lora_targets": ATTN_TARGETS, "steps": args.steps,
                      "warmup": args.warmup, "fp8_skip_patterns": FP8_SKIP, "optimizer": "AdamW (fp32 LoRA)",
                      "autocast": "bf16"},
           "details": results, "total_seconds": time.perf_counter() - t0}
    out_path.write_text(json.dumps(doc, indent=1, default=str))
    rows = [("figure", "value", "goal", "meets")]
    for f in figs:
        rows.append((f["name"], "n/a" if math.isnan(f["value"]) else f"{f['value']:.3f} {f['unit']}", f["goal"],
                     "yes" if f["meets"] else "NO"))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    print()
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for r in results:
        if r["error"]:
            print(f"  {r['config']}: {r['error']}")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
