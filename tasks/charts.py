"""The charts a person looks at: `<run dir>/loss.png` (loss per step and its running mean, the learning rate,
the validation loss) and a sweep's `loss.png` (the members' curves overlaid). matplotlib, drawn off-screen;
the same numbers give the same PNG bytes (no date or version in the file's metadata)."""
from __future__ import annotations

import os
from pathlib import Path

CODE_VERSION = "1"  # in the stored loss chart's key (tasks/publish.py): a change to the drawing draws it again
WIDTH_IN, HEIGHT_IN, DPI = 8.0, 5.0, 100
_NO_STAMP = {"Software": None}  # matplotlib writes its version otherwise: an upgrade would change the bytes


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of the last `window` values at each step (fewer at the start): what the log line prints."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def lr_schedule(train_cfg, steps: int) -> list[float]:
    """The learning rate each step used, from the run's schedule (train.lr, lr_scheduler, warmup_steps): the
    schedule diffusers builds for training, stepped on a throwaway optimizer."""
    import torch
    from diffusers.optimization import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=float(train_cfg.lr))
    schedule = get_scheduler(train_cfg.lr_scheduler, opt, num_warmup_steps=train_cfg.warmup_steps,
                             num_training_steps=train_cfg.max_steps)
    lrs = []
    for _ in range(steps):
        lrs.append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
    return lrs


def _pyplot():
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache's first build logs at INFO
    matplotlib.use("Agg", force=True)  # no screen; never a GUI backend in a worker
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fig.savefig(tmp, format="png", dpi=DPI, metadata=_NO_STAMP)
    os.replace(tmp, path)
    return path


def loss_chart(path: Path, step_losses: list[float], window: int, lrs: list[float] | None = None,
               validation: list[dict] | None = None, title: str = "") -> Path | None:
    """Loss per step (thin) and its running mean over `window` steps (named so in the legend), validation
    loss points where there are any, and below it the learning rate per step. None without losses."""
    if not step_losses:
        return None
    plt = _pyplot()
    steps = list(range(1, len(step_losses) + 1))
    rows = 2 if lrs else 1
    fig, axes = plt.subplots(rows, 1, figsize=(WIDTH_IN, HEIGHT_IN), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1][:rows]})
    ax = axes[0][0]
    ax.plot(steps, step_losses, color="#9bb7d4", linewidth=0.8, label="loss per step")
    ax.plot(steps, running_mean(step_losses, window), color="#1f4e79", linewidth=1.8,
            label=f"mean of the last {window} steps")
    if validation:
        ax.plot([v["step"] for v in validation], [v["loss"] for v in validation], "o-", color="#c0504d",
                markersize=4, label="validation loss (held-out items)")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title or "training loss", fontsize=10)
    if lrs:
        lr_ax = axes[1][0]
        lr_ax.plot(steps, lrs[:len(steps)], color="#4f7f3f", linewidth=1.2)
        lr_ax.set_ylabel("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        lr_ax.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def overlay_chart(path: Path, curves: dict[str, list[dict]], title: str = "") -> Path | None:
    """Each member's logged loss ([{step, loss}]: the mean of each log window, as report.json holds it), one
    line per member (its label in the legend). None when no member has a curve."""
    curves = {label: c for label, c in curves.items() if c}
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN))
    for label, points in curves.items():
        ax.plot([p["step"] for p in points], [p["loss"] for p in points], "o-", markersize=3, linewidth=1.5,
                label=label)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean of each window of train.log_every steps)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title or "sweep: training loss per member", fontsize=10)
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
