"""Pretrain the demo's tiny Flux base on the generated shape world (tasks/demo/world.py).

Usage: python -m scripts.pretrain_demo_base [out_dir]      (default: data/demo_base; about 10 min on 2 cores)

1. build_tiny_flux with a wider arch (real diffusers/transformers classes, random weights);
2. train the VAE as an autoencoder on base-world images, then set its shift/scaling factors to the latents'
   mean and 1/std (as FLUX.1's VAE);
3. keep both text encoders as built (random but fixed) and embed every caption as loraflow does;
4. train the transformer with flow matching, as FluxAdapter.training_loss does (guidance 1.0);
5. save the FluxPipeline (safetensors) into out_dir.

The base never sees the concept (world.CONCEPT). Deterministic: fixed seeds and thread count, deterministic
algorithms, and the CPU kernels pinned to AVX2, so a rerun gives the same bytes on any AVX2 machine.
"""
from __future__ import annotations

import os

# Before torch is imported: kernels (and so the bytes) of any AVX2 CPU, a fixed thread count.
os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusers import FluxPipeline  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tasks.demo import world  # noqa: E402
from tasks.models.tiny.tiny_flux import build_tiny_flux  # noqa: E402

SEED = 0
# One thread: the same bytes on any machine, and on a shared CPU two OpenMP threads wait on each other
# (measured 10-20x slower per step while another process ran; one thread was steady).
THREADS = 1
MAX_SEQUENCE_LENGTH = 32  # conf/model/demo_flux.yaml's model.max_sequence_length
ARCH = {
    # transformer: inner dim 3 x 32 = 96; rope axes sum to the head dim
    "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 32, "num_attention_heads": 3,
    "axes_dims_rope": (8, 12, 12),
    # VAE: 16 latent channels (as real Flux), 4 blocks -> /8
    "latent_channels": 16, "vae_block_out_channels": (16, 32, 32, 32), "vae_layers_per_block": 1,
    "vae_norm_num_groups": 8,
}
# VAE_STEPS/DIT_STEPS env overrides: quick smoke runs only; the shipped base uses the defaults.
VAE_STEPS, VAE_BATCH, VAE_LR, VAE_KL = int(os.environ.get("VAE_STEPS", 600)), 16, 2e-3, 1e-6
_T0 = time.time()
DIT_STEPS, DIT_BATCH, DIT_LR = int(os.environ.get("DIT_STEPS", 3000)), 32, 1e-3


def base_images() -> tuple[list[str], torch.Tensor]:
    """Every base caption and its image, as (N, 3, 64, 64) in [-1, 1]."""
    captions = world.base_captions()
    pixels = np.stack([np.asarray(world.render(*world.parse(c))) for c in captions])
    return captions, torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1


def lr_at(step: int, steps: int, lr: float) -> float:
    # short linear warm-up, then cosine decay to 0: the last steps settle the weights
    return lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + np.cos(np.pi * step / steps))


def train_vae(vae, pixels: torch.Tensor, g: torch.Generator) -> None:
    """Reconstruction (+ a tiny KL, as SD/Flux VAEs) on base images with random 90-degree turns, flips and
    shifts: edges in every direction and place, so the VAE also carries shapes it never saw (the concept)."""
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, weight_decay=0.0)
    for step in range(VAE_STEPS):
        idx = torch.randint(0, len(pixels), (VAE_BATCH,), generator=g)
        x = pixels[idx]
        k, flip = int(torch.randint(0, 4, (1,), generator=g)), bool(torch.randint(0, 2, (1,), generator=g))
        dy, dx = torch.randint(-12, 13, (2,), generator=g).tolist()
        x = torch.roll(torch.rot90(x, k, (2, 3)), (dy, dx), (2, 3))
        x = x.flip(3) if flip else x
        dist = vae.encode(x).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=g)
        loss = torch.nn.functional.mse_loss(vae.decode(z).sample, x) + VAE_KL * dist.kl().mean()
        optimizer_step(opt, loss, vae.parameters(), lr_at(step, VAE_STEPS, VAE_LR))
        if step % 100 == 0 or step == VAE_STEPS - 1:
            print(f"vae step {step}: loss {loss.item():.5f} ({time.time() - _T0:.0f} s)", flush=True)
    vae.eval()


def optimizer_step(opt, loss, params, lr: float) -> None:
    """One AdamW step at `lr`, gradients clipped to norm 1 (both the VAE's and the transformer's loops)."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


@torch.no_grad()
def encode_text(pipe, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds, pooled): FluxAdapter.encode_text's computation (CLIP pooled, T5 last hidden state)."""
    clip_ids = pipe.tokenizer(texts, padding="max_length", max_length=pipe.tokenizer.model_max_length,
                              truncation=True, return_tensors="pt").input_ids
    pooled = pipe.text_encoder(clip_ids, output_hidden_states=False).pooler_output
    ids = pipe.tokenizer_2(texts, padding="max_length", max_length=MAX_SEQUENCE_LENGTH,
                           truncation=True, return_tensors="pt").input_ids
    return pipe.text_encoder_2(ids, output_hidden_states=False)[0], pooled


def train_transformer(transformer, latents, embeds, pooled, g: torch.Generator) -> None:
    """Flow matching as FluxAdapter.training_loss: packed latents, ids, timestep = sigma, velocity target."""
    transformer.train()
    opt = torch.optim.AdamW(transformer.parameters(), lr=DIT_LR, weight_decay=0.0)
    b, (c, h, w) = DIT_BATCH, latents.shape[1:]
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(embeds.shape[1], 3)
    guidance = torch.ones(b)  # the demo samples with guidance_scale 1.0
    for step in range(DIT_STEPS):
        idx = torch.randint(0, len(latents), (b,), generator=g)
        x0 = latents[idx]
        noise = torch.randn(x0.shape, generator=g)
        sigmas = torch.rand(b, generator=g).view(b, 1, 1, 1)  # uniform in [0, 1)
        noisy = FluxPipeline._pack_latents((1 - sigmas) * x0 + sigmas * noise, b, c, h, w)
        pred = transformer(hidden_states=noisy, timestep=sigmas.flatten(), guidance=guidance,
                           pooled_projections=pooled[idx], encoder_hidden_states=embeds[idx],
                           txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        pred = FluxPipeline._unpack_latents(pred, height=h * 8, width=w * 8, vae_scale_factor=8)
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        optimizer_step(opt, loss, transformer.parameters(), lr_at(step, DIT_STEPS, DIT_LR))
        if step % 250 == 0 or step == DIT_STEPS - 1:
            print(f"transformer step {step}: loss {loss.item():.4f} ({time.time() - _T0:.0f} s)", flush=True)
    transformer.eval()


def main(out_dir: str = "data/demo_base") -> None:
    t0, c0 = time.time(), time.process_time()
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    g = torch.Generator().manual_seed(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_flux(tmp, seed=SEED, arch=ARCH)
        pipe = FluxPipeline.from_pretrained(tmp, use_safetensors=True)
    captions, pixels = base_images()

    train_vae(pipe.vae, pixels, g)
    with torch.no_grad():
        z = pipe.vae.encode(pixels).latent_dist.mode()
        err = (pipe.vae.decode(z).sample - pixels).abs().mean().item()
    # Flux's convention: latents = (z - shift) * scale have mean 0, std 1. Rounded: readable configs.
    shift, scale = round(z.mean().item(), 4), round(1 / z.std().item(), 4)
    pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    print(f"vae: mean abs error {err:.4f} (of 2), shift_factor {shift}, scaling_factor {scale}", flush=True)

    embeds, pooled = encode_text(pipe, captions)
    train_transformer(pipe.transformer, (z - shift) * scale, embeds, pooled, g)

    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)  # no stale files from an older layout
    # from_pretrained recorded the temporary folder's name in the configs: a fixed name keeps reruns byte-identical
    for part in (pipe, pipe.vae, pipe.transformer, pipe.scheduler):
        part.register_to_config(_name_or_path="demo_base")
    pipe.save_pretrained(out, safe_serialization=True)
    print(f"saved {out}: wall {time.time() - t0:.0f} s, CPU {time.process_time() - c0:.0f} s")


if __name__ == "__main__":
    main(*sys.argv[1:2])
