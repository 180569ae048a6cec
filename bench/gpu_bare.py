"""bench/gpu.py's side-by-side figures: loraflow's train step and latent caching against bare loops doing the
same work on the same GPU, alternated in one process (medians reported).

Train step: FLUX.1-dev's transformer (random bf16 weights), rank-16 LoRA, gradient checkpointing, bf16
autocast, AdamW, one 1024 px image with cached text. Ours is prepared by `tasks.training.train_setup.prepare_denoiser`
and steps through the Flux adapter's `training_loss`; bare is FluxTransformer2DModel + peft's LoraConfig
(same rank, alpha, targets, gaussian init, fp32 LoRA weights) and a hand-written flow-matching step. Both
models are held at once, so the two alternate in rounds on a warm GPU.

Latent caching: `tasks.cache_latents.run` into an empty store against `AutoencoderKL.from_pretrained` + a
per-image encode loop (bench.compute.bench_latents, on the GPU when there is one), with FLUX.1's VAE
architecture (channels 128-256-512-512, 16 latent channels, random weights) built into the store by the
validate node from `model=tiny_flux` with the VAE keys of `model.arch` set, at 1024 px, in bf16.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

FLUX_VAE = {"latent_channels": 16, "vae_block_out_channels": [128, 256, 512, 512], "vae_layers_per_block": 2,
            "vae_norm_num_groups": 32}


def train_step_vs_bare(arch: dict, device, rank: int, resolution: int, text_len: int, rounds: int, steps: int) -> dict:
    """Median step time of ours and of the bare loop over `rounds` alternated rounds of `steps` steps each (the
    first round of each is a warm-up and is not counted)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig

    from bench.flux_train import TRAIN_CFG, build, inputs, train_step
    from tasks.config_schema import TrainConfig
    from tasks.training.memory import lora_targets
    from tasks.training.train_setup import make_optimizer

    adapter, ours, ours_params = build(arch, device, fp8=False, ckpt=True, rank=rank)
    # prepare_denoiser turned cuDNN's fused attention off (it crashed here); the bare loop runs with the same
    # attention kernels, so the two differ only in the code around them
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    targets = lora_targets(TrainConfig(target_modules=None), adapter)  # the Flux adapter's default, as ours
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            bare = FluxTransformer2DModel(**arch)
    finally:
        torch.set_default_dtype(previous)
    bare.requires_grad_(False)
    bare.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets))
    bare_params = [p for p in bare.parameters() if p.requires_grad]
    for p in bare_params:
        p.data = p.data.float()
    bare.enable_gradient_checkpointing()
    bare.train()
    latents, text = inputs(arch, resolution, text_len, 1, device)
    ours_opt = make_optimizer(TRAIN_CFG, ours_params)
    bare_opt = torch.optim.AdamW(bare_params, lr=TRAIN_CFG.lr, weight_decay=TRAIN_CFG.weight_decay)
    scheduler = FlowMatchEulerDiscreteScheduler()
    b, c, h, w = latents.shape
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, torch.bfloat16)
    txt_ids = torch.zeros(text_len, 3, device=device, dtype=torch.bfloat16)
    guidance = torch.full((b,), 1.0, device=device, dtype=torch.bfloat16)

    def ours_step(i):
        return train_step(adapter, ours, ours_params, ours_opt, scheduler, latents, text, [torch.Generator().manual_seed(i)])

    def bare_step(i):
        g = torch.Generator(device=device).manual_seed(i)
        noise = torch.randn(latents.shape, generator=g, device=device, dtype=latents.dtype)
        sigma = torch.rand(b, generator=g, device=device)
        s = sigma.view(-1, 1, 1, 1).to(latents.dtype)
        packed = FluxPipeline._pack_latents((1 - s) * latents + s * noise, b, c, h, w)
        target = FluxPipeline._pack_latents(noise - latents, b, c, h, w)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = bare(hidden_states=packed, timestep=sigma, guidance=guidance,
                        pooled_projections=text["pooled_prompt_embeds"], encoder_hidden_states=text["prompt_embeds"],
                        txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), target.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare_params, TRAIN_CFG.max_grad_norm)
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {"ours": [], "bare": []}
    for r in range(rounds):
        for name, step in (("ours", ours_step), ("bare", bare_step)) if r % 2 == 0 else (("bare", bare_step), ("ours", ours_step)):
            for i in range(steps):
                sync()
                t = time.perf_counter()
                loss = step(r * steps + i)
                loss.item()  # the step's end, as a training loop that logs its loss
                sync()
                if r > 0:
                    times[name].append(time.perf_counter() - t)
        print(f"  train step vs bare: round {r + 1}/{rounds}", flush=True)
    ours_m, bare_m = statistics.median(times["ours"]), statistics.median(times["bare"])
    del ours, bare, ours_params, bare_params, ours_opt, bare_opt
    return {"ours_step_s": times["ours"], "bare_step_s": times["bare"], "ours_median_s": ours_m,
            "bare_median_s": bare_m, "ratio": ours_m / bare_m, "goal": "<= 1.05", "meets": ours_m / bare_m <= 1.05,
            "setting": "bf16 base, gradient checkpointing, bf16 autocast, AdamW", "lora_targets": targets,
            "rounds": rounds, "steps_per_round": steps, "resolution": resolution, "text_len": text_len}


def latents_vs_bare(work: Path, images: int, resolution: int, reps: int) -> dict:
    """cache_latents against a bare VAE loop, FLUX.1's VAE architecture, bf16, on the GPU."""
    from bench.common import make_dataset, write_prompts
    from bench.compute import bench_latents
    from tasks import validate
    from tasks.config import compose, resolve_paths
    from tasks.store import Store

    work.mkdir(parents=True, exist_ok=True)
    data, prompts = work / "data", write_prompts(work / "prompts.txt", 2)
    make_dataset(data, images, resolution)
    cfg = resolve_paths(compose("train", [f"data.dir={data}", f"sample.prompts_file={prompts}",
                                          f"store.root={work / 'store'}", f"data.resolution={resolution}",
                                          "model.dtype=bfloat16"])[0])
    cfg.model.arch = dict(FLUX_VAE)
    store = Store(cfg.store.root)
    plan = validate.run(cfg, store)
    r = bench_latents(cfg, plan, store, work / "scratch", reps)
    r.pop("latent_keys", None)
    return {**r, "goal": ">= 0.95", "meets": r["ratio"] >= 0.95, "vae": FLUX_VAE, "dtype": "bfloat16"}
