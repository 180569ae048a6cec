"""An exported LoRA file as a faulty exporter would write it: the learning check (bench/learns.py) must catch
each (its ratio over the bound, or the loader refusing the file). Used by the bench on every family and by
tests/test_learns.py."""
from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(r"((?:^|[._])(?:[a-z]+_)?(?:blocks|layers)[._]\d+[._])")


def misnamed_block(src: Path, dst: Path) -> int:
    """One block's keys misnamed (the block holding most LoRA modules: `..blocks.0.` -> `..blocks.0x.`), as
    an exporter with a wrong name rule writes them; returns how many tensors were renamed."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src))
    blocks = [m.group(1) for k in tensors if (m := _BLOCK.search(k))]
    block = max(sorted(set(blocks)), key=blocks.count)
    out = {(k.replace(block, block[:-1] + "x" + block[-1], 1) if block in k else k): v for k, v in tensors.items()}
    save_file(out, str(dst), metadata=_metadata(src))
    return blocks.count(block)


def scale_halved(src: Path, dst: Path) -> None:
    """The LoRA's scale (alpha / rank) off by 2x, as a fused q/k/v whose rank triples without its alpha
    (kohya-ss/sd-scripts#2204) leaves it too small: kohya's alpha halved, or the up/B weights that carry the
    baked-in scale of a diffusers file. Not 2x too large: at memorisation the LoRA outweighs a random tiny base
    and the normalisation layers absorb an overshoot (measured: a ratio of 0.05 for Flux, 0.005 for SD1.5)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src))
    has_alpha = any(k.endswith(".alpha") for k in tensors)
    if any(".lokr_w1" in k for k in tensors):  # a LyCORIS LoKr file carries its scale in w1 (export_lycoris.py)
        scaled = (".lokr_w1", ".lokr_w1_a")
        out = {k: v / 2 if k.endswith(scaled) else v for k, v in tensors.items()}
    else:
        out = {k: v / 2 if (k.endswith(".alpha") if has_alpha else ".lora_B." in k) else v for k, v in tensors.items()}
    save_file(out, str(dst), metadata=_metadata(src))


def _metadata(file: Path) -> dict[str, str] | None:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return f.metadata()


FILE_MUTATIONS = {"misnamed_block": misnamed_block, "scale_halved": scale_halved}
