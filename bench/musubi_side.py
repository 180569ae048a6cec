"""Issue 45 item 4: musubi-tuner's own LoRA training step beside loraflow's, in one process, on the same DiT
architecture with random bf16 weights: step time, peak memory and MFU per setting, the two trainers alternated.

    bash bench/musubi_source.sh                        # once: musubi-tuner into bench/third_party/ (untracked)
    python -m bench.musubi_side                        # CUDA: Qwen-Image, 1024 px (bench/musubi_side.json)
    python -m bench.musubi_side --family flux_kontext  # FLUX.1 Kontext [dev] (needs einops for musubi's Flux)
    python -m bench.musubi_side --tiny                 # smoke test on any machine: a 3-block DiT at 64 px

Both sides: batch 1, 1024x1024 (128x128 latents, 2x2 patches: 4096 image tokens; Kontext adds its control image's
4096), 512 text tokens (all real: musubi passes no mask, loraflow an all-ones mask), LoRA rank 16 and alpha 16 in
fp32 on the same modules (musubi's defaults, below), gradient checkpointing of every block, AdamW lr 1e-4,
gradient clipping at 1.0, bf16 autocast. A step is forward, backward, clipping and the optimizer step (timed
with torch.cuda.synchronize); its median over `--steps` steps after `--warmup` per unit, pooled over `--rounds`
rounds; each round builds musubi's unit, then loraflow's, per setting (A B A B ...). Peak memory is
torch.cuda.max_memory_allocated over a unit's steps (model building excluded). MFU: the FLOPs of one step
(forward, checkpoint recompute, backward) counted by torch's FlopCounterMode in each trainer's first unit, over
the median step and the card's dense bf16 peak (bench.gpu_speed.PEAK_BF16: H100/H200 989e12). A unit that raises
is recorded (`error`) and the others still run. The JSON is rewritten after every unit (`complete` is false until
the last) and `--budget S` starts no unit after S seconds: a run cut short on a lent GPU keeps what it measured.

Settings (comma list; `+` joins parts): `bf16`; `fp8` (musubi `--fp8_base`: the whole DiT cast to float8_e4m3fn,
computed under autocast, vs loraflow `model.quantize=fp8` with its default `model.matmul=auto`: fp8 W8A8 matmuls
on a GPU with them, the row's `matmul` says); `fp8scaled` (musubi `--fp8_base --fp8_scaled`, the fp8 recipe its
Qwen-Image docs give, block-scaled weights; loraflow has no scaled fp8: `model.quantize=fp8` again);
`dequant` (loraflow `model.matmul=dequantize`); `swapN` (musubi `--blocks_to_swap N` vs loraflow
`train.blocks_to_swap=N`); `h2d` / `pinned` (musubi `--block_swap_h2d_only` / `--use_pinned_memory_for_block_swap`,
CUDA only; loraflow's swap is always host-to-device only and pinned).

musubi-tuner (kohya-ss/musubi-tuner at MUSUBI_COMMIT, src/musubi_tuner/), what each unit runs of it:
- the DiT: qwen_image/qwen_image_model.py QwenImageTransformer2DModel with create_model's config (60 blocks, 3072
  wide: diffusers' config too), attn_mode "torch" (`--sdpa`); flux/flux_models.py Flux(configs_flux_dev_context).
  Random bf16 weights made on the device replace load_qwen_image_model / load_flow_model's file; `--fp8_scaled`
  runs that loader's fp8 step on them (optimize_state_dict_with_fp8 + apply_fp8_monkey_patch, with
  FP8_OPTIMIZATION_TARGET_KEYS / _EXCLUDE_KEYS; Flux.fp8_optimization);
- training/trainer_base.py NetworkTrainer: _load_dit_and_swap's block swap (enable_block_swap with
  BlockSwapConfig.from_args, move_to_device_except_swap_blocks), _build_network's LoRA
  (networks/lora_qwen_image.py / lora_flux.py create_arch_network, apply_to) and enable_gradient_checkpointing,
  get_optimizer (`--optimizer_type adamw`), _prepare_with_accelerator (the fp8 cast, accelerator.prepare,
  prepare_block_swap_before_forward), and _run_training_loop's step: process_batch
  (get_noisy_model_input_and_timesteps, call_dit, compute_loss), accelerator.backward, clip_grad_norm_,
  optimizer.step, zero_grad (no lr scheduler: a constant lr); accelerator from training/accelerator_setup.py
  prepare_accelerator; the arguments parsed by its own parser (training/parser_common.py setup_parser_common +
  the family's setup_parser) from the flags its docs give (docs/qwen_image.md, flux_kontext.md);
- qwen_image_train_network.py QwenImageNetworkTrainer.call_dit; flux_kontext_train_network.py
  FluxKontextNetworkTrainer.call_dit.
Those trainer modules import musubi's dataset and sampling code at import time (cv2, voluptuous, torchvision),
which the step never runs and loraflow's environment does not have: so the methods above are compiled from
musubi's own source text (ast, unchanged, their file and line numbers kept: `from_source`) into one small class;
everything else is imported as it is. The loader's CPU-first placement of a swapped model is skipped (weights are
made on the device; musubi's prepare_block_swap_before_forward then moves the swapped blocks' weights to the host:
the same placement at the first step).

musubi's LoRA targets are its defaults: for Qwen-Image every Linear of a QwenImageTransformerBlock (its `_mod_`
exclude pattern matches no dotted module name, so the AdaLN modulation linears img_mod.1 / txt_mod.1 are in), for
Kontext every Linear of the double/single blocks but the modulation and norms. loraflow trains the same modules
(peft; diffusers' Qwen-Image names are musubi's, Flux's are unfused: q/k/v where musubi has one qkv Linear, so
Kontext's loraflow LoRA has more parameters at the same rank; `lora_params` per row), unless `--targets own`
(each trainer's own default: loraflow's is the image-stream attention). Process-wide: cuDNN attention is off
for both (loraflow's train node turns it off; its backward crashed at 4608 tokens, bench/RESULTS.md)."""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

from bench.flux_train import FLUX_DEV
from bench.gpu_speed import peak_flops
from bench.musubi_settings import (
    GIB, HERE, KONTEXT_TINY, MUSUBI_COMMIT, MusubiMissing, QWEN_IMAGE, QWEN_TINY, RANK, Setting, make_inputs,
    max_swap,
)
from bench.musubi_units import LoraflowUnit, MusubiUnit, cpu_cuda_calls, load_musubi


def run_unit(trainer: str, family: str, setting: Setting, a, arch: dict, device, data: dict, count_flops: bool) -> dict:
    import torch

    cuda = device.type == "cuda"
    swap = min(setting.swap, max_swap(family, arch))
    out = {"setting": setting.name, "trainer": trainer, "swap": swap, "step_s": [], "error": None}
    unit = None
    with ExitStack() as stack:
        if trainer == "musubi" and swap and not cuda:
            stack.enter_context(cpu_cuda_calls())
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            unit = (MusubiUnit(family, setting, swap, arch, device, data) if trainer == "musubi"
                    else LoraflowUnit(family, setting, swap, arch, device, data, a.targets))
            out.update(unit.info, build_s=time.perf_counter() - t, lora_params=unit.lora_params)
            if count_flops:
                out["flops"] = step_flops(unit)
            if cuda:
                torch.cuda.synchronize()
                out["weights_gib"] = torch.cuda.memory_allocated() / GIB
                torch.cuda.reset_peak_memory_stats()
            for step in range(a.warmup + a.steps):
                t = time.perf_counter()
                loss = unit.step(step)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t
                if step >= a.warmup:
                    out["step_s"].append(dt)
                print(f"  {trainer} {setting.name}: step {step + 1}/{a.warmup + a.steps} {dt:.3f} s "
                      f"loss {loss.item():.4g}", flush=True)
                del loss
        except Exception as e:  # recorded; the other units still run
            out["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            out["traceback"] = traceback.format_exc()[-3000:]
            print(f"  {trainer} {setting.name}: {out['error']}", flush=True)
        finally:
            if unit is not None:
                unit.close()
            del unit
            gc.collect()
            if cuda:
                try:  # after a CUDA error the context may be gone: keep the error above
                    out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                    torch.cuda.empty_cache()
                except Exception as e:  # noqa: BLE001
                    out["error"] = out["error"] or f"{type(e).__name__}: {e}"
    return out


def step_flops(unit) -> float:
    """FLOPs of one step's loss and backward (forward, checkpoint recompute, backward), counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        unit.backward(unit.loss(0))
    unit.zero_grad()
    return float(counter.get_total_flops())


def summarise(units: list[dict], peak: float | None) -> list[dict]:
    """One row per (setting, trainer): the median of every measured step of its rounds, the largest peak."""
    rows, flops = {}, {u["trainer"]: u["flops"] for u in units if u.get("flops")}
    for u in units:
        r = rows.setdefault((u["setting"], u["trainer"]), {
            "setting": u["setting"], "trainer": u["trainer"], "step_s": None, "peak_gib": None, "mfu": None,
            "error": None, "steps": [], "rounds": 0, "flops": flops.get(u["trainer"])})
        r["rounds"] += 1
        r["steps"] += u["step_s"]
        r["error"] = r["error"] or u["error"]
        if u.get("peak_gib") is not None:
            r["peak_gib"] = max(r["peak_gib"] or 0.0, u["peak_gib"])
        for k in ("swap", "musubi_flags", "loraflow_overrides", "matmul", "lora_params", "lora_modules", "weights_gib"):
            if k in u:
                r[k] = u[k]
        r.setdefault("tracebacks", []).extend([u["traceback"]] if u.get("traceback") else [])
    for r in rows.values():
        r["step_s"] = statistics.median(r["steps"]) if r["steps"] else None
        if r["step_s"] and r["flops"] and peak:
            r["mfu"] = r["flops"] / r["step_s"] / peak
    return list(rows.values())


def figures(rows: list[dict], family: str, arch_name: str) -> list[dict]:
    out = []
    by = {(r["setting"], r["trainer"]): r for r in rows}
    for setting in dict.fromkeys(r["setting"] for r in rows):
        mu, lf = by.get((setting, "musubi"), {}), by.get((setting, "loraflow"), {})
        if mu.get("step_s") and lf.get("step_s"):
            value = lf["step_s"] / mu["step_s"]
            out.append({"name": f"musubi-tuner vs loraflow, {arch_name} {setting}: loraflow/musubi step ratio "
                                f"(rank {RANK}, checkpointing, AdamW)", "value": value, "unit": "x",
                        "goal": "<= 1.0", "meets": value <= 1.0})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.musubi_side", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny DiT at 64 px: a smoke test on any machine")
    ap.add_argument("--family", choices=("qwenimage", "flux_kontext"), default="qwenimage")
    ap.add_argument("--settings", default="bf16,fp8,swap16", help="comma list (module docstring); default %(default)s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per unit")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps first, per unit")
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default 1024; --tiny 64)")
    ap.add_argument("--text-len", type=int, default=None, help="text tokens (default 512; --tiny 16)")
    ap.add_argument("--targets", choices=("musubi", "own"), default="musubi",
                    help="LoRA modules: musubi's defaults on both sides, or each trainer's own default")
    ap.add_argument("--budget", type=float, default=None, help="seconds: start no unit after this many")
    ap.add_argument("--out", default=None, help="default bench/musubi_side[_flux_kontext][_tiny].json")
    a = ap.parse_args(argv)
    try:
        settings = [Setting.parse(s) for s in a.settings.split(",") if s]
        load_musubi(a.family)
    except (ValueError, MusubiMissing) as e:
        print(e, file=sys.stderr)
        return 2
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # for both (module docstring)
    full = FLUX_DEV if a.family == "flux_kontext" else QWEN_IMAGE
    arch = (KONTEXT_TINY if a.family == "flux_kontext" else QWEN_TINY) if a.tiny else full
    a.resolution = a.resolution or (64 if a.tiny else 1024)
    a.text_len = a.text_len or (16 if a.tiny else 512)
    name = {"qwenimage": "Qwen-Image", "flux_kontext": "FLUX.1 Kontext [dev]"}[a.family]
    arch_name = f"{'tiny ' if a.tiny else ''}{name} {a.resolution} px"
    data = make_inputs(a.family, arch, a.resolution, a.text_len, device)
    suffix = ("" if a.family == "qwenimage" else f"_{a.family}") + ("_tiny" if a.tiny else "")
    out = Path(a.out or HERE / f"musubi_side{suffix}.json")
    peak = peak_flops(device)
    head = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "musubi_commit": MUSUBI_COMMIT,
            "family": a.family, "arch": arch_name, "torch": torch.__version__, "resolution": a.resolution,
            "text_len": a.text_len, "rank": RANK, "targets": a.targets, "rounds": a.rounds, "steps": a.steps,
            "warmup": a.warmup, "peak_bf16_flops": peak}
    units, rows, figs, t0, counted = [], [], [], time.time(), set()
    plan = [(r, s, trainer) for r in range(a.rounds) for s in settings for trainer in ("musubi", "loraflow")]
    for r, s, trainer in plan:  # A B, every setting, every round
        if a.budget and time.time() - t0 > a.budget:
            print(f"--budget {a.budget} s spent: {len(plan) - len(units)} units not run", flush=True)
            break
        print(f"round {r + 1}/{a.rounds} {s.name} {trainer} ...", flush=True)
        units.append(run_unit(trainer, a.family, s, a, arch, device, data, count_flops=trainer not in counted))
        counted |= {trainer} if units[-1].get("flops") else set()
        rows = summarise(units, peak)  # written after every unit: a run cut short keeps what it measured
        figs = figures(rows, a.family, arch_name)
        result = {**head, "complete": len(units) == len(plan), "rows": rows, "figures": figs,
                  "seconds": round(time.time() - t0, 1)}
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    for r in rows:
        nan = float("nan")
        print(f"{r['setting']:>14} {r['trainer']:>8}: {r['step_s'] or nan:.3f} s  MFU {r['mfu'] or nan:.3f}"
              f"  peak {r['peak_gib'] or nan:.2f} GiB  {r['error'] or ''}")
    for f in figs:
        print(f"{f['name']}: {f['value']:.3f} ({'meets' if f['meets'] else 'misses'} {f['goal']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
