"""Validation loss (issue 22, item 6): held-out items (data.validation_split) scored during training.

The held-out items are a fixed, seeded choice: the images sorted by a hash of their name (a fixed salt, not
train.seed, so a seed sweep holds out the same images) and the first ceil(split x N) taken. They are items
of the plan (cached like the others) but never drawn for training. Every train.validate_every_n_steps steps
and at the last step, each one is scored by the family's own `training_loss` under torch.no_grad() at
DRAWS fixed timesteps and noises, drawn from generators seeded by (VALIDATION_SEED, item name, k): the same
draws at every step and in every run, so the curve is comparable across steps and runs."""
from __future__ import annotations

import math

from tasks.config import Config, ConfigError
from tasks.config_schema import TrainConfig
from tasks.data.controls import stacked
from tasks.store.hashing import key_int, key_of
from tasks.lazy import lazy

torch = lazy("torch")

VALIDATION_SEED = "validation-1"  # the salt of the held-out choice and of the validation draws
DRAWS = 4  # fixed (timestep, noise) draws per held-out item


def held_out(items: list[dict], split: float) -> list[str]:
    """The names of the held-out items, in plan order: a seeded choice among the images (not regularisation
    images, not flipped twins); a held-out image's flipped twin (data.flip_aug) is held out with it."""
    if not split:
        return []
    candidates = [it["name"] for it in items if "flip_of" not in it and not it.get("is_reg")]
    n = math.ceil(split * len(candidates))
    if n >= len(candidates):
        raise ConfigError(f"data.validation_split={split}: holds out {n} of the {len(candidates)} training image(s), "
                          "leaving none to train on; use a smaller split"
                          + (f" (below {(len(candidates) - 1) / len(candidates):.3g})" if len(candidates) > 1 else
                             " or data.validation_split=0 (one image cannot be split)"))
    chosen = set(sorted(candidates, key=lambda name: key_of([VALIDATION_SEED, name]))[:n])
    return [it["name"] for it in items if it["name"] in chosen or it.get("flip_of") in chosen]


def generators(name: str, draws: int = DRAWS) -> list[torch.Generator]:
    """The fixed generators of a held-out item: independent of the training seed and step."""

    return [torch.Generator("cpu").manual_seed(key_int(VALIDATION_SEED, name, k)) for k in range(draws)]


def due(step: int, every: int, max_steps: int) -> bool:
    return step == max_steps or bool(every and step % every == 0)


def errors(cfg: Config) -> list[str]:
    split, every = cfg.data.validation_split, cfg.train.validate_every_n_steps
    out = []
    if not (isinstance(split, (int, float)) and 0 <= split < 1):
        out.append(f"data.validation_split={split!r}: must be in [0, 1) (the fraction of images held out; 0: off)")
    if every < 0:
        out.append(f"train.validate_every_n_steps={every!r}: must be 0 (at the last step only) or a number of steps")
    elif every and not split:
        out.append(f"train.validate_every_n_steps={every} needs held-out images: set data.validation_split (e.g. 0.1)")
    return out


def held_controls(store, kind: str, items: list[dict], control_keys: list[list[str]], held: list[str]) -> list[list]:
    """Each held-out item's control entries (edit pairs, image-to-video; [] without), in `held`'s order."""
    keys = {it["name"]: ks for it, ks in zip(items, control_keys)}
    return [[store.get_tensors(kind, k) for k in keys[n]] for n in held]


def score(adapter, denoiser, accelerator, names: list[str], latents, texts, tc: TrainConfig, scheduler,
          controls: list[list] | None = None) -> float:
    """The mean loss over the held-out items and their DRAWS fixed draws, with the current LoRA. No global
    RNG is used and the model is put back in its mode: the training trajectory is unchanged.

    `latents[i]` / `texts.get(i, step, generator)`: the held-out item i's stored latent and caption (the
    caption chosen with its own fixed generator, at the last step: past any token warm-up); `controls[i]`: its
    control latents (edit pairs), beside it as in training."""
    was_training = denoiser.training
    denoiser.eval()  # no dropout (which would draw from the global RNG)
    losses = []
    try:
        with torch.no_grad():
            for i, name in enumerate(names):
                gens = generators(name)
                stored = latents[i]
                captions = [texts.get(i, tc.max_steps, g) for g in gens]
                text = {k: torch.stack([c[k] for c in captions]) for k in captions[0]}
                text.update({k: torch.stack([v] * len(gens)) for k, v in stored.items() if k != "latents"})
                batch = torch.stack([stored["latents"]] * len(gens)).to(accelerator.device, adapter.dtype)
                if controls and controls[i]:  # [draws, K, C, h, w], as training batches them
                    text.update(stacked([controls[i]] * len(gens)))
                text = {k: v.to(accelerator.device) for k, v in text.items()}
                with accelerator.autocast():
                    loss = adapter.training_loss(denoiser, batch, text, tc, scheduler, gens)
                losses.append(float(loss.float().item()))
    finally:
        denoiser.train(was_training)
    return sum(losses) / len(losses)
