"""bench/learns.json as bench/RESULTS.md's "Does a LoRA learn?" section (between markers, rewritten by each
`python -m bench.learns` run)."""
from __future__ import annotations

from pathlib import Path

from bench.file_mutations import FILE_MUTATIONS

REPO = Path(__file__).resolve().parents[1]
BOUND = 0.2  # the goal: the LoRA takes the render 5x closer to the image than the base is
# The pretrained demo base is held to more: it already draws the world, so a right LoRA only adds one shape
# (measured 0.0036), while a wrong timestep or latent convention makes the LoRA fight what the base knows and
# re-learn it (measured 0.0195 to 0.057: tests/test_learns_mutations.py). 0.01 sits between, ~2x from each:
# an empirical bound of this base, not a rounding figure (the runs are deterministic on the AVX2 kernels).
BOUNDS = {"demo_flux": 0.01}
RENDER_STEPS = 20


def bound(model: str) -> float:
    return BOUNDS.get(model, BOUND)


def shown(v: float | str, model: str) -> str:
    if isinstance(v, str):
        return "refused"
    return f"{v:.3f}" + ("" if v > bound(model) else " (not caught)")


RESULTS = REPO / "bench" / "RESULTS.md"
_BEGIN, _END = "<!-- learns: begin -->", "<!-- learns: end -->"


def results_table(result: dict) -> str:
    """bench/learns.json as the RESULTS.md section (between markers, rewritten by each run)."""
    lines = [_BEGIN, "## Does a LoRA learn? (`python -m bench.learns`)", "",
             f"Measured {result.get('date', '?')} on {result.get('machine', '?')}. One 64 px image, memorised; each "
             "exported file loaded into the family's own diffusers pipeline and the caption rendered from noise "
             f"({RENDER_STEPS} steps). ratio = err_lora / err_base (mean squared distance of the latent handed to "
             f"`vae.decode` from the image's own latent); goal <= {BOUND} (demo_flux, the pretrained base: "
             f"<= {BOUNDS['demo_flux']}). The tiny models are widened and the LoRAs of SD3, Qwen-Image, SDXL and "
             "SD1.5 target more than the default (MLPs; the UNets' convolutions): `settings` in the JSON, and "
             "docs/learning.md for why. c: the ComfyUI file where it is not the kohya file (Z-Image: fused q/k/v, "
             "merged by ComfyUI's rule). s: wall time, CLI included, on a machine that may have been busy (the "
             "JSON's date and seconds are those of each model's last run). Raw: `bench/learns.json`.", ""]
    if demo := result.get("demo"):
        lines += [f"Demo (`make run`): concept_before {demo['concept_before']:.2f} (goal <= 0.2), concept_after "
                  f"{demo['concept_after']:.2f} (>= 0.8), base_kept {demo['base_kept']:.2f} (>= 0.8).", ""]
    lines += ["| model | ratio (diffusers file) | kohya file (loader) | err_base | err_lora | misnamed block (d, k[, c]) "
              "| scale halved (d, k[, c]) | width, rank, steps, lr | s |", "|---|---|---|---|---|---|---|---|---|"]
    for model, r in result["families"].items():
        st = r["settings"]
        arch = ", ".join(f"{k}={v}" for k, v in st["arch"].items()) or "default"
        muts = " | ".join(", ".join(shown(v, model) for v in r.get("mutations", {}).get(m, {}).values()) or "-"
                          for m in FILE_MUTATIONS)
        lines.append(f"| {model} | {r['ratio']:.3f} | {r['files'].get('kohya', float('nan')):.3f} "
                     f"({r['loaders'].get('kohya', '-')}) | {r['err_base']:.4g} | {r['err_lora']:.4g} | {muts} | {arch}; "
                     f"r{st['rank']}, {st['steps']} steps, lr {st['lr']} | {st['seconds']} |")
    on_images = {m: r["images"] for m, r in result["families"].items() if r.get("images")}
    if on_images:  # issue 48: the same settings on the generated images (bench/learns_images.py)
        names = list(next(iter(on_images.values())))
        lines += ["", "On generated images (bench/learns_images.py; the diffusers file's ratio, each at the family's "
                  "settings above):", "", "| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {m} | " + " | ".join(f"{imgs[n]:.3f}" if n in imgs else "-" for n in names) + " |"
                  for m, imgs in on_images.items()]
    return "\n".join(lines + ["", _END])


def write_results(result: dict) -> None:
    text = RESULTS.read_text()
    section = results_table(result)
    if _BEGIN in text:
        head, rest = text.split(_BEGIN, 1)
        text = head + section + rest.split(_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS.write_text(text)
