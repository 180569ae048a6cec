"""Loss options shared by every family's training_loss: noise offset, l2 or (pseudo-)Huber, min-SNR weighting.

Meanings are sd-scripts' (library/train_util.py) and diffusers' (examples/text_to_image/train_text_to_image_lora.py,
diffusers.training_utils.compute_snr). At their defaults (noise_offset 0, loss l2, min_snr_gamma None) every
function returns exactly what the families computed before, bit for bit, so stored LoRAs keep their keys."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tasks.config_schema import TrainConfig
from tasks.lazy import lazy

torch = lazy("torch")
F = lazy("torch.nn.functional")
training_utils = lazy("diffusers.training_utils")


@dataclass
class BatchTrainConfig(TrainConfig):
    """train.* plus what one batch brings to its loss: the regularisation images' weights (None: all 1) and
    the pixel masks on the latent grid (None: no mask). Not settings: the train loop fills them per batch."""
    item_weights: list[float] | None = None
    loss_mask: Any = None


def for_batch(tc: TrainConfig, item_weights: list[float] | None, loss_mask) -> TrainConfig:
    """tc itself when the batch brings nothing (the common case), else a BatchTrainConfig."""
    if item_weights is None and loss_mask is None:
        return tc
    return BatchTrainConfig(**{f.name: getattr(tc, f.name) for f in fields(TrainConfig)},
                            item_weights=item_weights, loss_mask=loss_mask)


def offset_noise(noise: torch.Tensor, train_cfg: TrainConfig, generators: list[torch.Generator]) -> torch.Tensor:
    """sd-scripts' --noise_offset: noise + noise_offset * randn(b, c, 1, 1), one constant per item and channel.
    Drawn from the item's generator after its other draws (CPU, like the noise), so the timesteps and noise of a
    run without an offset are unchanged; no draw at all when the offset is 0."""
    offset = float(train_cfg.noise_offset or 0.0)
    if not offset:
        return noise
    shape = (noise.shape[1],) + (1,) * (noise.ndim - 2)  # (c, 1, 1); a video latent's (c, 1, 1, 1)
    shift = torch.stack([torch.randn(shape, generator=g, dtype=noise.dtype) for g in generators])
    return noise + offset * shift.to(noise.device)


def elementwise(pred: torch.Tensor, target: torch.Tensor, train_cfg: TrainConfig) -> torch.Tensor:
    """Per-element loss in fp32. huber: sd-scripts' loss_type=huber (a pseudo-Huber loss) with its "constant"
    huber_schedule, 2c(sqrt(d^2 + c^2) - c): ~d^2 for |d| << c, ~2c|d| beyond, so outliers pull linearly."""
    diff = pred.float() - target.float()
    if train_cfg.loss == "huber":
        c = float(train_cfg.huber_c)
        loss = 2 * c * (torch.sqrt(diff ** 2 + c ** 2) - c)
    else:
        loss = diff ** 2
    return masked(loss, train_cfg)


def masked(loss: torch.Tensor, train_cfg: TrainConfig) -> torch.Tensor:
    """data.mask_dir / alpha_mask: the per-element loss times the item's mask on the latent grid ([B, 1, h, w],
    broadcast over channels), as sd-scripts' apply_masked_loss; the mean stays over every element (not over
    the mask's area), as there, so a learning rate tuned in sd-scripts means the same here."""
    mask = getattr(train_cfg, "loss_mask", None)
    return loss if mask is None else loss * mask.to(loss.device, loss.dtype)


def min_snr_weights(scheduler, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """Min-SNR-gamma weights (Hang et al. 2023) per item, as diffusers' train_text_to_image_lora.py: min(SNR, gamma)
    divided by SNR for an epsilon target, by SNR + 1 for a v-prediction target."""
    snr = training_utils.compute_snr(scheduler, timesteps)
    weights = torch.stack([snr, gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    prediction_type = scheduler.config.prediction_type
    if prediction_type == "epsilon":
        return weights / snr
    if prediction_type == "v_prediction":
        return weights / (snr + 1)
    raise ValueError(f"train.min_snr_gamma: no min-SNR weighting for prediction_type {prediction_type!r}")


def item_weighted(per_item: torch.Tensor, train_cfg: TrainConfig) -> torch.Tensor:
    """The batch mean of per-item losses, each times its `item_weights` entry when the train loop sets them
    (train.prior_loss_weight for regularisation images, kohya's loss * loss_weights then mean)."""
    weights = getattr(train_cfg, "item_weights", None)
    if weights is not None:
        per_item = per_item * torch.tensor(weights, dtype=per_item.dtype, device=per_item.device)
    return per_item.mean()


def ddpm_loss(pred, target, train_cfg: TrainConfig, scheduler, timesteps) -> torch.Tensor:
    """The epsilon / v-prediction families' mean loss (SD1.5, SDXL)."""
    gamma = train_cfg.min_snr_gamma
    if train_cfg.loss == "l2" and gamma is None and getattr(train_cfg, "item_weights", None) is None \
            and getattr(train_cfg, "loss_mask", None) is None:
        return F.mse_loss(pred.float(), target.float(), reduction="mean")  # the examples' loss, unchanged
    per_item = elementwise(pred, target, train_cfg).mean(dim=list(range(1, pred.ndim)))
    if gamma is not None:
        per_item = per_item * min_snr_weights(scheduler, timesteps, float(gamma)).to(per_item.device)
    return item_weighted(per_item, train_cfg)


def flow_loss(pred, target, weighting: torch.Tensor, train_cfg: TrainConfig) -> torch.Tensor:
    """The flow-matching families' mean loss (Flux, SD3), weighted per item by the weighting scheme."""
    loss = (weighting.float() * elementwise(pred, target, train_cfg)).reshape(pred.shape[0], -1)
    if getattr(train_cfg, "item_weights", None) is None:
        return loss.mean()  # as before, bit for bit
    return item_weighted(loss.mean(dim=1), train_cfg)
