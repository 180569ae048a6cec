"""One LoHa / LoKr of a fused Linear from those of the Linears that are its row blocks, exactly: the LyCORIS file in
ComfyUI's names (tasks/training/export_lycoris.py) for a family whose ComfyUI model fuses them (HunyuanVideo 1.5's
q, k and v are one `img_attn.qkv` there). tasks/models/lora_variants/lycoris.py `split_fused` reads it back.

- LoHa: dW = (w1a @ w1b) * (w2a @ w2b) * alpha / rank, element by element, so row blocks stack: w1a and w2a
  block-diagonal, w1b and w2b stacked; rank n * r, alpha n * alpha (the same alpha / rank).
- LoKr: dW = kron(w1, w2), and kron([w1_q; w1_k; w1_v], w2) = [kron(w1_q, w2); kron(w1_k, w2); kron(w1_v, w2)]
  holds for ONE w2 only: the slots must share it (training ties it, tasks/training/train_setup.py). w1 stacked
  (materialised where factorised: to_lycoris's alpha = r leaves ComfyUI a scale of 1 either way), w2 as it is.

A slot that was not trained (train.target_modules) adds zeros of the first slot's shapes: the fused Linears here
(q, k, v) are of one width. Pure core."""
from __future__ import annotations

from tasks.lazy import lazy

torch = lazy("torch")


def fuse(network: str, module: str, slots: list[dict | None]) -> dict:
    """`slots`: each row block's LyCORIS parts as to_lycoris writes them (scales in place, with `alpha`), None
    where a slot was not trained -> the fused module's parts."""
    present = [p for p in slots if p is not None]
    first = present[0]
    if any(float(p["alpha"]) != float(first["alpha"]) for p in present):
        raise ValueError(f"{module}: its row blocks' alphas differ")
    if network == "loha":
        zero = {k: torch.zeros_like(v) for k, v in first.items()}
        parts = [p if p is not None else zero for p in slots]
        out = {f"hada_w{i}_a": torch.block_diag(*[p[f"hada_w{i}_a"] for p in parts]) for i in (1, 2)}
        out.update({f"hada_w{i}_b": torch.cat([p[f"hada_w{i}_b"] for p in parts]) for i in (1, 2)})
        return {**out, "alpha": first["alpha"] * len(slots)}
    w2 = {k: v for k, v in first.items() if k.startswith("lokr_w2")}
    for p in present[1:]:
        mine = {k: v for k, v in p.items() if k.startswith("lokr_w2")}
        if mine.keys() != w2.keys() or any(not torch.equal(mine[k], v) for k, v in w2.items()):
            raise ValueError(f"{module}: the LoKr of its row blocks must share w2 to be one Kronecker product "
                             "(trained with it shared: tasks/training/train_setup.py)")
    w1 = [None if p is None else p["lokr_w1"] if "lokr_w1" in p else p["lokr_w1_a"] @ p["lokr_w1_b"] for p in slots]
    zero = torch.zeros_like(next(w for w in w1 if w is not None))
    return {"lokr_w1": torch.cat([w if w is not None else zero for w in w1]), **w2, "alpha": first["alpha"]}
