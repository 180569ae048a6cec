"""The LoRA maths, on the in-memory form of formats.py ({module: Pair(down, up, alpha)}, delta = alpha/rank * up @
down). No files here.

Precision: resize and merge work in float64 on factors of rank r, never on the out x in delta (a QR of each factor
and an SVD of an r x r core), so they are cheap for any model and their only float32 rounding is the final cast
of the factors. extract must take the SVD of the full out x in difference: float32, on --device."""
from __future__ import annotations

from typing import NamedTuple

from tasks.lazy import lazy
from tasks.lora_tools.lora_files import LoraToolError, Pair

torch = lazy("torch")


class Kept(NamedTuple):
    """What a truncation kept of one module: energy = squared Frobenius norm of the delta."""
    rank_in: int
    rank_out: int
    kept: float
    total: float


def delta(p: Pair, dtype=None) -> "torch.Tensor":
    """The module's weight change, out x in (float64 unless told)."""
    dtype = dtype or torch.float64
    return (p.up.to(dtype) @ p.down.to(dtype)) * p.scale


def _factor_svd(p: Pair):
    """SVD of scale * up @ down without forming it: up = Qu Ru, down^T = Qd Rd, so the delta is
    Qu (scale Ru Rd^T) Qd^T and the SVD of the small core gives the delta's: U = Qu Uc, V = Qd Vc."""
    qu, ru = torch.linalg.qr(p.up.double())
    qd, rd = torch.linalg.qr(p.down.double().T)
    uc, s, vch = torch.linalg.svd(p.scale * ru @ rd.T, full_matrices=False)
    return qu @ uc, s, vch @ qd.T


def _factors(u, s, vh, k: int, alpha: float | None, dtype) -> Pair:
    """The rank-k truncation as a Pair. sqrt(S) goes to both factors: their magnitudes match, which keeps a
    float16/bfloat16 file from underflowing one factor. alpha None: alpha = k (scale 1); otherwise up is divided
    by alpha / k so the delta is the same."""
    root = s[:k].sqrt()
    up, down = u[:, :k] * root, root[:, None] * vh[:k]
    a = float(k) if alpha is None else float(alpha)
    return Pair(down.to(dtype).contiguous(), (up * (k / a)).to(dtype).contiguous(), a)


def resize(modules: dict, rank: int, alpha: float | None = None) -> tuple[dict, dict]:
    """Each module's delta truncated to rank `rank` (the best rank-`rank` approximation in Frobenius norm,
    Eckart-Young); a module of lower rank keeps its own. Returns (modules, {module: Kept})."""
    out, stats = {}, {}
    for name, p in modules.items():
        u, s, vh = _factor_svd(p)
        k = min(rank, len(s))
        out[name] = _factors(u, s, vh, k, alpha, p.down.dtype)
        energy = s.square()
        stats[name] = Kept(p.rank, k, energy[:k].sum().item(), energy.sum().item())
    return out, stats


def merge(loras: list[dict], weights: list[float], what: list[str]) -> dict:
    """One LoRA whose delta is sum_i w_i delta_i, exactly: ranks are concatenated (down stacked, up side by side)
    and each w_i * alpha_i / rank_i is folded into its up, so alpha = the new rank (scale 1). A module in only
    some files is kept with their terms."""
    out = {}
    names = sorted({n for lora in loras for n in lora})
    for name in names:
        terms = [(lora[name], w, src) for lora, w, src in zip(loras, weights, what) if name in lora]
        p0, _, src0 = terms[0]
        for p, _, src in terms[1:]:
            if p.down.shape[1] != p0.down.shape[1] or p.up.shape[0] != p0.up.shape[0]:
                raise LoraToolError(f"{src}: {name} is {p.up.shape[0]}x{p.down.shape[1]}, in {src0} "
                                    f"{p0.up.shape[0]}x{p0.down.shape[1]}: LoRAs of different models cannot merge")
        dtype = p0.down.dtype
        for p, _, _ in terms:
            dtype = torch.promote_types(dtype, p.down.dtype)
        down = torch.cat([p.down.to(dtype) for p, _, _ in terms])
        up = torch.cat([(p.up.double() * (w * p.scale)).to(dtype) for p, w, _ in terms], dim=1)
        out[name] = Pair(down, up, float(down.shape[0]))
    return out


def apply(state_dict: dict, modules: dict, weight: float, what: str) -> int:
    """state_dict[module.weight] += weight * delta, in place, each tensor keeping its dtype (the sum in float64,
    one rounding to the model's dtype). `modules` are diffusers names without the component prefix."""
    for name, p in modules.items():
        key = f"{name}.weight"
        w = state_dict.get(key)
        if w is None:
            raise LoraToolError(f"{what}: {name} is not a weight of the base model: a LoRA of another model?")
        if tuple(w.shape) != (p.up.shape[0], p.down.shape[1]):
            raise LoraToolError(f"{what}: {name} is {p.up.shape[0]}x{p.down.shape[1]}, the base model's "
                                f"{w.shape[0]}x{w.shape[1]}: a LoRA of another model?")
        state_dict[key] = (w.double() + weight * delta(p)).to(w.dtype)
    return len(modules)


def extract(base: dict, tuned: dict, linears, rank: int, device: str = "cpu") -> tuple[dict, dict, list[str]]:
    """A LoRA of the tuned model's change: for each Linear (module name without prefix) whose weight differs,
    the rank-`rank` truncated SVD of tuned - base (float32). Returns (modules, {module: Kept}, unchanged names)."""
    out, stats, same = {}, {}, []
    for name in linears:
        key = f"{name}.weight"
        a, b = base.get(key), tuned.get(key)
        if a is None and b is None:  # the widest layout's names (single files): a smaller model has fewer
            continue
        if a is None or b is None:
            side = "base" if a is None else "tuned"
            raise LoraToolError(f"--{side}: has no {key}: the two models are not of the same architecture")
        if a.shape != b.shape:
            raise LoraToolError(f"--tuned: {key} is {tuple(b.shape)}, in --base {tuple(a.shape)}: the two models "
                                "are not of the same architecture")
        if torch.equal(a, b):
            same.append(name)
            continue
        d = b.to(device, torch.float32) - a.to(device, torch.float32)
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        k = min(rank, len(s))
        out[name] = _factors(u, s, vh, k, None, torch.float32)
        out[name] = Pair(out[name].down.cpu(), out[name].up.cpu(), out[name].alpha)
        energy = s.double().square()
        stats[name] = Kept(len(s), k, energy[:k].sum().item(), energy.sum().item())
    return out, stats, same
