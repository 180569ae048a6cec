"""A LoRA learns, and the check that says so can fail (issue 29; bench/learns.py).

The fastest families run here: each trains on one image until its LoRA memorises it, and every exported
file, loaded into the family's own diffusers pipeline, must render the caption from noise to a latent 5x
closer to the image's than the base renders (ratio <= bench.learns.BOUND). The other families' checks are
the bench's (`python -m bench.learns`, committed in bench/learns.json). Then each mutation of tests/learning.py
must push the ratio over the bound: training mutations in tests/test_learns_mutations.py, file mutations here.

Each bound is the issue's goal (0.2), not a rounding figure: a ratio is a property of the training run, and
the runs are deterministic on the AVX2 kernels `make test` uses (the same bytes every time; so a pass or a
fail is not a matter of luck), with margins recorded in bench/learns.json."""
from __future__ import annotations

import pytest

from bench import learns
from learning import FILES

FAST = ["tiny_flux", "tiny_sd15"]  # a flow-matching transformer and a DDPM UNet: both loss kinds
# and the pretrained demo base (data/demo_base), at its own bound; LoKr / LoHa (their LyCORIS file); and FLUX.1
# Kontext, FLUX.2 [klein] (a reference image) and Qwen-Image-Edit on one (control, target) pair, rendered given
# the control; and trained on an int8 / NF4 base (model.quantize), rendered on the full one
# (Qwen-Image-Edit's, the slowest, is in tests/test_qwenimage_edit.py: another file, another worker of `make test`)
CHECKED = [*FAST, "demo_flux", "tiny_flux+lokr", "tiny_flux+loha", "tiny_flux_kontext", "tiny_flux2_klein+ref",
           "tiny_flux+int8", "tiny_flux+nf4"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    runs = {}

    def get(model):
        if model not in runs:
            root = tmp_path_factory.mktemp(model)
            learns.dataset(root, model)
            base, files = learns.train_nodes(model, root)
            runs[model] = (base, files, learns.evaluate(model, base, files))
        return runs[model]
    return get


@pytest.mark.parametrize("model", CHECKED)
def test_lora_memorises_its_image(model, trained):
    _, _, r = trained(model)
    assert set(r["files"]) == ({"lycoris"} if "+lo" in model else {"diffusers", "kohya"})
    for fmt, ratio in r["files"].items():
        assert ratio <= learns.bound(model), \
            f"{model} {fmt} ({r['loaders'][fmt]}): err ratio {ratio:.4f} > {learns.bound(model)}"


@pytest.mark.parametrize("mutation", sorted(FILES))
@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
@pytest.mark.parametrize("model", FAST)
def test_file_mutation_is_caught(model, fmt, mutation, trained, tmp_path):
    base, files, good = trained(model)
    assert good["files"][fmt] <= learns.BOUND
    bad = tmp_path / files[fmt].name
    FILES[mutation](files[fmt], bad)
    r = learns.evaluate(model, base, {fmt: bad})
    assert r["files"][fmt] > learns.BOUND, f"{model} {fmt}: {mutation} not caught (ratio {r['files'][fmt]:.3f})"
