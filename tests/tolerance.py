"""Every numeric tolerance of the suite, derived here and nowhere else.

Where determinism is promised (same config, same data, same process count, same kernels) a test compares
bytes or uses `torch.equal`: no tolerance. Where two computations of the same maths may round differently
(another summation order, a fused against an unfused LoRA, a batch split across processes, another CPU's
kernels) the bound is `rounding()`:

    |a - b| <= TAIL * stages * sqrt(n) * u * magnitude

- `u` is the dtype's unit roundoff, eps / 2 (float32: 2**-24, bfloat16: 2**-8);
- `n` is the number of terms in the longest sum behind a value (a layer's width, a mean's count): a sum of n
  terms rounded in another order differs by about sqrt(n) * u of its magnitude, since each addition rounds
  by an independent +-u/2 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., sec. 2.8);
- `stages` is how many such sums are chained (layers, sampling steps, optimizer steps): to first order their
  errors add;
- `magnitude` is the size of the values compared (their largest absolute value, where the caller has them);
- `TAIL` = 8: sqrt(n) * u is the standard deviation of that error; the largest of M elements stays within
  sqrt(2 ln M) of it, which is below 8 for any tensor of under 10**13 elements.

Adam's update is the exception: it divides a gradient by its own magnitude, so where a gradient is near zero
a rounding-level difference can flip its sign and move that weight by a whole step. No epsilon bounds that;
Adam's step size does (`adam_drift`).

Set LORAFLOW_TOLERANCE_LOG=FILE to append each comparison's largest difference and its bound as a JSON line
(what the closing notes' margins are read from)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

TAIL = 8.0
# Not rounding: what a feature promises (the memory preflight: within 10 % of the measured peak).
PREFLIGHT_WITHIN = 0.10


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def rounding(n: int, *, stages: int = 1, dtype: torch.dtype = torch.float32, magnitude: float = 1.0) -> float:
    """The bound above: two roundings of the same maths, `stages` chained sums of `n` terms each."""
    return TAIL * stages * math.sqrt(max(n, 1)) * unit_roundoff(dtype) * magnitude


def _modules(part, calls: int = 1):
    """(module, calls) pairs in a part: a module, (module, calls), a dict/list/tuple holding modules, a
    diffusers pipeline, or an object holding modules (an adapter's text encoders come with their tokenizers,
    which have no sums)."""
    if isinstance(part, torch.nn.Module):
        yield part, calls
    elif isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], torch.nn.Module) and isinstance(part[1], int):
        yield part
    elif isinstance(part, dict):
        for v in part.values():
            yield from _modules(v, calls)
    elif isinstance(part, (list, tuple)):
        for v in part:
            yield from _modules(v, calls)
    elif isinstance(getattr(part, "components", None), dict):  # a diffusers pipeline
        yield from _modules(part.components, calls)
    elif hasattr(part, "__dict__"):  # an adapter's holder of encoders and tokenizers
        yield from _modules([v for v in vars(part).values() if isinstance(v, torch.nn.Module)], calls)


def sums(*parts) -> dict:
    """`n` and `stages` of a computation through real modules, counted from them: each part is a module,
    (module, calls) (a denoiser called once a sampling step) or a container of modules. Every Linear and Conv
    is one chained sum (q, k and v side by side count three times: an over-count, so the bound only loosens) of
    in_features, or in_channels / groups x kernel size, terms; `n` is the widest."""
    n, stages = 1, 0
    for module, calls in (pair for part in parts for pair in _modules(part)):
        for m in module.modules():
            if isinstance(m, torch.nn.Linear):
                terms = m.in_features
            elif isinstance(m, torch.nn.modules.conv._ConvNd):
                terms = m.in_channels // m.groups * math.prod(m.kernel_size)
            else:
                continue
            n, stages = max(n, terms), stages + calls
    assert stages, "no Linear or Conv found: nothing to count the bound from"
    return {"n": n, "stages": stages}


def render_sums(pipe, steps: int) -> dict:
    """`sums` of a render: the denoiser once a step, then the VAE's decoder (the text encoders run alike in
    both renders compared, so they add no difference)."""
    denoiser = pipe.transformer if hasattr(pipe, "transformer") else pipe.unet
    return sums((denoiser, steps), pipe.vae.decoder)


def adam_step_ratio(t: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam can reach at step t (bias-corrected), for any gradients: by
    Cauchy-Schwarz over the two moving averages, (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt(sum (b1^2/b2)^k).
    It is 1 at t=1 (the update is lr * sign(g))."""
    b1, b2 = betas
    geometric = sum((b1 * b1 / b2) ** k for k in range(t))
    return (1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2)) * math.sqrt(geometric)


def adam_drift(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The most two AdamW runs from the same start can differ in any one weight after `steps` steps, whatever
    their gradients: each moves it by at most lr * adam_step_ratio(t) a step (decoupled weight decay only
    shrinks a difference). Rigorous, and large: it holds whatever the kernels, the batch split or the CPU."""
    return 2 * lr * sum(adam_step_ratio(t, betas) for t in range(1, steps + 1))


def _log(what: str, diff: float, bound: float) -> None:
    path = os.environ.get("LORAFLOW_TOLERANCE_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "what": what, "diff": diff, "bound": bound}) + "\n")


def assert_close(actual, expected, *, n: int, stages: int = 1, dtype: torch.dtype | None = None,
                 magnitude: float | None = None, what: str = "") -> None:
    """Tensors (or arrays) equal to `rounding()`; the magnitude defaults to the expected values' largest."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    dtype = dtype or expected.dtype
    if magnitude is None:
        magnitude = max(expected.abs().max().item(), 1e-30) if expected.numel() else 1.0
    bound = rounding(n, stages=stages, dtype=dtype, magnitude=magnitude)
    diff = (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
    _log(what, diff, bound)
    assert diff <= bound, (f"{what or 'values'} differ by {diff:.3e}, more than rounding allows: {bound:.3e} "
                           f"(n={n}, stages={stages}, {dtype}, magnitude {magnitude:.3g})")


def close(a: float, b: float, *, n: int, stages: int = 1, dtype: torch.dtype = torch.float32, what: str = "") -> bool:
    """Scalars equal to `rounding()` relative to their size (for lists of losses and the like)."""
    bound = rounding(n, stages=stages, dtype=dtype, magnitude=max(abs(a), abs(b)))
    _log(what, abs(a - b), bound)
    return abs(a - b) <= bound


def approx(expected, *, n: int, stages: int = 1, dtype: torch.dtype = torch.float32):
    """pytest.approx at `rounding()` relative to each value (a scalar or a list)."""
    return pytest.approx(expected, rel=rounding(n, stages=stages, dtype=dtype), abs=0)


def assert_within_adam_drift(actual: dict, expected: dict, *, lr: float, steps: int, what: str = "LoRA") -> None:
    """Two LoRA state dicts trained from the same start by AdamW: every weight within `adam_drift`."""
    assert actual.keys() == expected.keys(), f"{what}: other tensors"
    diff, bound = max((actual[k] - expected[k]).abs().max().item() for k in expected), adam_drift(lr, steps)
    _log(what, diff, bound)
    assert diff <= bound, f"{what} weights differ by {diff:.3e}, beyond Adam's step bound {bound:.3e}"


def assert_losses_close(actual: list[float], expected: list[float], *, n: int, what: str = "losses") -> None:
    """Per-step losses of two runs that round differently: step t's loss is a mean of n terms computed from
    weights that went through t-1 optimizer steps, so its bound grows with t."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} steps against {len(expected)}"
    for t, (a, b) in enumerate(zip(actual, expected), start=1):
        assert close(a, b, n=n, stages=t, what=f"{what}[{t}]"), (
            f"{what}: step {t} loss {a!r} against {b!r}, beyond rounding: "
            f"{rounding(n, stages=t, magnitude=max(abs(a), abs(b))):.3e}")
