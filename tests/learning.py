"""Mutations of loraflow that each train a falling loss yet a wrong LoRA (issue 29): the learning check
(bench/learns.py) must catch every one. Training mutations are monkeypatched into loraflow's own code for one
run; file mutations (bench/file_mutations.py) edit an exported file as a faulty exporter would have
written it."""
from __future__ import annotations

import torch

import tasks.models.bases.flow_matching as flow_matching
import tasks.models.bases.unet as unet
from bench.file_mutations import FILE_MUTATIONS

def _flow_modules():
    """The modules whose training_loss calls noise_latents / weighted_loss, imported by name (so patched there):
    every adapter module of the registry and the shared bases that import them."""
    import sys

    from tasks.models import FAMILIES, adapter_class

    for family in FAMILIES:
        adapter_class(family)  # imports the family's module and its bases
    return [m for name, m in sorted(sys.modules.items())
            if name.startswith("tasks.models.") and m is not flow_matching and hasattr(m, "weighted_loss")]


def sign_flipped(monkeypatch, family: str) -> None:
    """The training target's sign: x0 - noise for a velocity, -noise for an epsilon."""
    if family in ("sd15", "sdxl"):
        real = unet.ddpm_loss
        monkeypatch.setattr(unet, "ddpm_loss", lambda pred, target, *a, **k: real(pred, -target, *a, **k))
        return
    real = flow_matching.weighted_loss
    for m in _flow_modules():
        monkeypatch.setattr(m, "weighted_loss", lambda pred, target, *a, **k: real(pred, -target, *a, **k))


def _timesteps(monkeypatch, family: str, change) -> None:
    """The denoiser is told `change(t)` where t (0..num_train_timesteps) is the noise level it is given."""
    if family in ("sd15", "sdxl"):
        real = unet.UNetAdapter.training_loss

        def loss(self, denoiser, *a, **k):
            def told(noisy, t, *rest, **kw):
                return denoiser(noisy, change(t.float(), 1000), *rest, **kw)
            told.dtype, told.device = denoiser.dtype, denoiser.device
            return real(self, told, *a, **k)

        monkeypatch.setattr(unet.UNetAdapter, "training_loss", loss)
        return
    real = flow_matching.noise_latents

    def noise_latents(latents, train_cfg, scheduler, generators):
        noisy, noise, t, sigmas = real(latents, train_cfg, scheduler, generators)
        return noisy, noise, change(t, scheduler.config.num_train_timesteps), sigmas

    for m in _flow_modules():  # where a module draws through its own import (the I2V ones draw through wan's)
        if hasattr(m, "noise_latents"):
            monkeypatch.setattr(m, "noise_latents", noise_latents)


def timestep_reversed(monkeypatch, family: str) -> None:
    """t vs 1-t: the noise level the model is told is the opposite of the one it sees."""
    _timesteps(monkeypatch, family, lambda t, n: n - t)


def timestep_unscaled(monkeypatch, family: str) -> None:
    """A missing 1000x: the model is told t / 1000 (a 0..1 convention fed to a 0..1000 model)."""
    _timesteps(monkeypatch, family, lambda t, n: t / n)


def latent_scale_dropped(monkeypatch, family: str) -> None:
    """The cache forgets the VAE's latent normalisation: scaling/shift factors (Flux, SD3, Z-Image, SD),
    latents_mean/std (Qwen-Image), the batch-norm statistics (FLUX.2)."""
    from tasks.models import adapter_class

    cls = adapter_class(family)
    real = cls.load_vae

    def load_vae(self):
        vae = real(self)
        c = vae.config
        if hasattr(vae, "bn"):  # FLUX.2
            with torch.no_grad():
                vae.bn.running_mean.zero_()
                vae.bn.running_var.fill_(1.0 - c.batch_norm_eps)
        elif c.get("latents_mean") is not None:
            vae.register_to_config(latents_mean=[0.0] * len(c.latents_mean), latents_std=[1.0] * len(c.latents_std))
        else:
            vae.register_to_config(scaling_factor=1.0, shift_factor=0.0 if c.get("shift_factor") is not None else None)
        return vae

    monkeypatch.setattr(cls, "load_vae", load_vae)


TRAINING = {"sign": sign_flipped, "timestep_reversed": timestep_reversed, "timestep_unscaled": timestep_unscaled,
            "latent_scale": latent_scale_dropped}


# -- file mutations: bench/learns.py's (the bench records them for every family) ------------------------------
FILES = FILE_MUTATIONS


def learns_within_bound(model: str, root, formats=("diffusers", "kohya")) -> tuple:
    """bench/learns.py's check at the node functions: `model` trained on its one image or clip under `root`, each
    exported file rendered by the family's pipeline within the model's bound. Returns (base, files, result)."""
    from bench import learns

    learns.dataset(root, model)
    base, files = learns.train_nodes(model, root)
    r = learns.evaluate(model, base, files)
    assert set(r["files"]) == set(formats), r["files"]
    for fmt, ratio in r["files"].items():
        assert ratio <= learns.bound(model), f"{model} {fmt}: err ratio {ratio:.4f} > {learns.bound(model)}"
    return base, files, r
