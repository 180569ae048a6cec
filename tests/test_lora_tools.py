"""tasks/lora_tools (`loraflow-lora`): resize, merge, convert, extract and merge --into-base, on real files of the
tiny models, checked against maths done here independently (float64, from the PEFT state dict the files were
made from, or from the files' tensors read with safetensors alone).

Tolerances, all from the float32 unit roundoff u = 2**-24 (a float32 rounding of x is within u*|x|):
- a scale folded into a factor (up' = fl(s * up)) moves each delta entry by at most u * s * (|up| @ |down|):
  `fold_bound`; the tools' other steps on files (padding, fusing, splitting, concatenating) copy bytes;
- a float64 SVD result stored as float32 factors U sqrt(S), sqrt(S) V^T moves the product by at most
  2u * ||U sqrt(S)||_F * ||sqrt(S) V^T||_F = 2u * sum(kept singular values) in Frobenius norm (first order);
  twice that is allowed for the second-order term and the float64 arithmetic (about 1e-16 relative);
- a weight merged into the model is one float32 rounding of a float64 sum: within u * |W + delta| (twice that
  for the float64 sum's own rounding);
- two forward passes of the same maths in another order (LoRA applied vs merged): tests/tolerance.py's
  rounding(), counted from the model's own Linears and Convs (`sums`)."""
from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from tasks.models import adapter_class
from tasks.training.export import kohya_metadata, kohya_rows
from lora_tools_checks import RANK, U, assert_deltas, deltas, denoiser, fold_bound, peft_lora, read, run
from tolerance import assert_close, rounding, sums


def kohya_rows_of(family, model_dir, module):
    """The diffusers Linears of a kohya module (export.kohya_rows on the model's own Linear names)."""
    names = [n for n, m in denoiser(family, model_dir).named_modules() if isinstance(m, torch.nn.Linear)]
    return kohya_rows(family, names)[module.removeprefix("lora_unet_")]


# ---------------------------------------------------------------- resize
@pytest.mark.numerics  # LAPACK's and the forward pass's kernels: rounding-level results
@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_resize_error_is_the_svd_tail(layout, model_dirs, tmp_path, capsys):
    _, _, _ = peft_lora("flux", model_dirs("flux"), tmp_path)
    src = tmp_path / ("pytorch_lora_weights.safetensors" if layout == "diffusers" else "lora_kohya.safetensors")
    before = deltas(src)
    assert run("resize", src, tmp_path / "r2.safetensors", "--rank", 2) == 0
    printed = capsys.readouterr().out
    after, factors = deltas(tmp_path / "r2.safetensors"), read(tmp_path / "r2.safetensors")
    assert after.keys() == before.keys()
    kept = total = 0.0
    for m, d in before.items():
        s = torch.linalg.svdvals(d)
        assert factors[m][0].shape[0] == 2 and factors[m][2] == 1.0  # rank 2, alpha = rank
        err, tail = (after[m] - d).norm().item(), s[2:].square().sum().sqrt().item()
        assert abs(err - tail) <= 4 * U * s[:2].sum().item(), f"{m}: error {err} != dropped {tail}"
        kept, total = kept + s[:2].square().sum().item(), total + s.square().sum().item()
    assert f"energy kept {100 * kept / total:.4f} % in total" in printed  # the squared Frobenius norms add


@pytest.mark.numerics  # LAPACK's and the forward pass's kernels: rounding-level results
def test_resize_to_full_rank_is_exact_and_alpha_is_kept_out_of_the_delta(model_dirs, tmp_path):
    peft_lora("flux", model_dirs("flux"), tmp_path)
    src = tmp_path / "lora_kohya.safetensors"
    before = deltas(src)
    for alpha in (None, 16.0):  # --rank above every module's rank: each keeps its own (the fused qkv: 12)
        out = tmp_path / f"full_{alpha}.safetensors"
        assert run("resize", src, out, "--rank", 64, *(["--alpha", alpha] if alpha else [])) == 0
        after, factors = deltas(out), read(out)
        for m, d in before.items():
            assert factors[m][0].shape[0] == read(src)[m][0].shape[0]
            assert factors[m][2] * factors[m][0].shape[0] == (alpha or factors[m][0].shape[0])  # the alpha asked
            bound = 4 * U * torch.linalg.svdvals(d).sum().item()
            assert (after[m] - d).abs().max().item() <= bound, m


# ---------------------------------------------------------------- merge
@pytest.mark.numerics  # LAPACK's and the forward pass's kernels: rounding-level results
def test_merge_is_the_weighted_sum(model_dirs, tmp_path):
    d1, d2 = tmp_path / "one", tmp_path / "two"
    _, ref1, f1 = peft_lora("flux", model_dirs("flux"), d1)
    # another rank, alpha and target set: some modules are only in one file
    _, ref2, f2 = peft_lora("flux", model_dirs("flux"), d2, targets=["to_q", "to_k", "ff.net.2"], rank=2, alpha=5.0,
                            seed=2, kohya=False)
    w1, w2 = 0.7, -0.4
    out = tmp_path / "merged.safetensors"
    # the first LoRA as its kohya file: converted to the output's (diffusers) layout on the way
    assert run("merge", d1 / "lora_kohya.safetensors", d2 / "pytorch_lora_weights.safetensors",
               "--weights", f"{w1},{w2}", out, "--format", "diffusers") == 0
    in_kohya = {m: d for m, d in ref1.items() if m != "proj_out"}  # the kohya file leaves proj_out out (export.py)
    expected = {f"transformer.{m}": w1 * in_kohya.get(m, 0) + w2 * ref2.get(m, 0) for m in {*in_kohya, *ref2}}
    b1 = fold_bound({m: f for m, f in f1.items() if m in in_kohya}, {m: w1 for m in f1})
    b2 = fold_bound(f2, {m: w2 for m in f2})
    bound = {f"transformer.{m}": b1.get(m, 0) + b2.get(m, 0) for m in {*in_kohya, *ref2}}
    assert_deltas(deltas(out), expected, bound, "merge")
    ranks = {m: a.shape[0] for m, (a, _, _) in read(out).items()}
    assert ranks["transformer.transformer_blocks.0.attn.to_q"] == RANK + 2  # ranks concatenated
    assert ranks["transformer.transformer_blocks.0.attn.to_v"] == RANK

    # diffusers reads the mixed ranks (rank_pattern) at scale 1: its LoRA layers hold the file's delta
    flux = denoiser("flux", model_dirs("flux"))
    pipe_cls = adapter_class("flux").pipeline_cls
    state_dict, alphas, metadata = pipe_cls.lora_state_dict(str(out), return_alphas=True, return_lora_metadata=True)
    pipe_cls.load_lora_into_transformer(state_dict, alphas, transformer=flux, metadata=metadata)
    for m, d in expected.items():
        layer = flux.get_submodule(m.removeprefix("transformer."))
        (name,) = layer.lora_A.keys()
        got = layer.scaling[name] * (layer.lora_B[name].weight.double() @ layer.lora_A[name].weight.double())
        assert ((got - d).abs() <= 2 * bound[m]).all(), m

    # --rank re-compresses the merged delta M. The tools truncate M' (M with its scales folded in: M' - M is
    # within the fold bound), so the error to M lies in [tail(M), tail(M) + 2 ||M' - M||_F] (Eckart-Young and
    # Weyl), plus the stored factors' rounding (2u * sum of the kept singular values, twice for safety).
    small = tmp_path / "merged_r3.safetensors"
    assert run("merge", d1 / "pytorch_lora_weights.safetensors", d2 / "pytorch_lora_weights.safetensors",
               "--weights", f"{w1},{w2}", "--rank", 3, small) == 0
    b1 = fold_bound(f1, {m: w1 for m in f1})
    for m, d in deltas(small).items():
        m = m.removeprefix("transformer.")
        target = w1 * ref1.get(m, 0) + w2 * ref2.get(m, 0)
        s = torch.linalg.svdvals(target)
        tail, err = s[3:].square().sum().sqrt().item(), (d - target).norm().item()
        folded = 2 * (b1.get(m, torch.zeros(1)) + b2.get(m, torch.zeros(1))).norm().item()
        assert -4 * U * s[:3].sum().item() <= err - tail <= 2 * folded + 4 * U * s[:3].sum().item(), m


# ---------------------------------------------------------------- kohya <-> diffusers
@pytest.mark.parametrize("family", ["flux", "sdxl", "zimage"])
def test_kohya_diffusers_round_trip(family, model_dirs, tmp_path):
    _, ref, factors = peft_lora(family, model_dirs(family), tmp_path)
    kohya = tmp_path / "lora_kohya.safetensors"
    if family == "flux":  # the kohya file leaves out the top-level proj_out (export.py)
        ref, factors = ({m: v for m, v in x.items() if m != "proj_out"} for x in (ref, factors))
    prefix = adapter_class(family).denoiser_subfolder + "."
    # the family comes from the kohya file's ss_base_model_version; the names from the family's widest layout
    assert run("convert", kohya, tmp_path / "d.safetensors", "--format", "diffusers") == 0
    got = read(tmp_path / "d.safetensors")
    assert {m: a.shape[0] for m, (a, _, _) in got.items()} == {prefix + m: RANK for m in ref}  # trained rank back
    bound = {prefix + m: b for m, b in fold_bound(factors).items()}
    assert_deltas(deltas(tmp_path / "d.safetensors"), {prefix + m: d for m, d in ref.items()}, bound, family)

    assert run("convert", tmp_path / "d.safetensors", tmp_path / "k.safetensors", "--format", "kohya",
               "--model", model_dirs(family)) == 0  # the family from the file's metadata, the names from the model
    original, back = deltas(kohya), deltas(tmp_path / "k.safetensors")
    k_factors = read(kohya)
    assert_deltas(back, original, fold_bound(k_factors), f"{family} back to kohya")
    with safe_open(str(tmp_path / "k.safetensors"), "pt") as f:
        assert f.metadata()["ss_base_model_version"] == kohya_metadata(family, 1, 1)["ss_base_model_version"]


# ---------------------------------------------------------------- into the base model
def test_into_base_flux_kohya_weights_are_base_plus_delta(model_dirs, tmp_path):
    flux_dir = model_dirs("flux")
    _, ref, factors = peft_lora("flux", flux_dir, tmp_path)
    out, w = tmp_path / "merged.safetensors", 0.8
    assert run("merge", tmp_path / "lora_kohya.safetensors", "--into-base", flux_dir, "--weight", w, out) == 0
    base = load_file(flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    merged = FluxTransformer2DModel.from_single_file(str(out), config=str(flux_dir), subfolder="transformer",
                                                     local_files_only=True).state_dict()
    assert merged.keys() == base.keys()
    changed = {f"{m}.weight" for m in ref if m != "proj_out"}  # the kohya file has no proj_out
    for k, v in base.items():
        if k not in changed:
            assert torch.equal(merged[k], v), k
            continue
        exact = v.double() + w * ref[k[: -len(".weight")]]
        assert ((merged[k].double() - exact).abs() <= 2 * U * exact.abs()).all(), k


@pytest.mark.numerics  # LAPACK's and the forward pass's kernels: rounding-level results
def test_into_base_sd15_original_layout_matches_the_lora_applied_model(model_dirs, tmp_path):
    sd15 = model_dirs("sd15")
    lora_model, _, _ = peft_lora("sd15", sd15, tmp_path, kohya=False)
    out = tmp_path / "merged.safetensors"
    assert run("merge", tmp_path / "pytorch_lora_weights.safetensors", "--into-base", sd15, "--layout", "original",
               out) == 0
    assert all(k.startswith("model.diffusion_model.") for k in load_file(out))  # A1111's UNet keys
    merged = UNet2DConditionModel.from_single_file(str(out), config=str(sd15), subfolder="unet",
                                                   local_files_only=True)
    gen = torch.Generator().manual_seed(0)
    cfg = merged.config
    x = torch.randn(1, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=gen)
    text = torch.randn(1, 7, cfg.cross_attention_dim, generator=gen)
    with torch.no_grad():
        got = merged(x, 500, text).sample
        want = lora_model(x, 500, text).sample
        plain = denoiser("sd15", sd15)(x, 500, text).sample
    bound = sums(merged)
    assert (want - plain).abs().max() > rounding(**bound, magnitude=want.abs().max().item()), "LoRA changes nothing"
    assert_close(got, want, **bound, what="merged UNet vs LoRA-applied UNet")


@pytest.mark.parametrize("family", ["sd3", "zimage", "qwenimage", "flux2_klein"])
def test_into_base_original_layout_reads_back_in_diffusers(family, model_dirs, tmp_path):
    """SD3's original layout (SAI's MMDiT names), Z-Image's (fused qkv, ComfyUI's names) and Qwen-Image's
    (diffusers' names) read back by diffusers' own from_single_file converter into exactly the merged
    diffusers-layout weights."""
    model_dir = model_dirs(family)
    peft_lora(family, model_dir, tmp_path, kohya=False)
    lora, plain, original = tmp_path / "pytorch_lora_weights.safetensors", tmp_path / "d.safetensors", tmp_path / "o.safetensors"
    assert run("merge", lora, "--into-base", model_dir, plain) == 0
    assert run("merge", lora, "--into-base", model_dir, "--layout", "original", original) == 0
    back = adapter_class(family).denoiser_cls.from_single_file(
        str(original), config=str(model_dir), subfolder="transformer", local_files_only=True).state_dict()
    want = load_file(plain)
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)
    keys = load_file(original).keys()
    if family == "zimage":  # the released layout, not diffusers'
        assert any(k.endswith(".attention.qkv.weight") for k in keys) and not any(".attention.to_" in k for k in keys)
    if family == "sd3":
        assert any(k.startswith("joint_blocks.0.x_block.attn.qkv") for k in keys) and "final_layer.linear.weight" in keys
    if family == "flux2_klein":
        assert "double_blocks.0.img_attn.qkv.weight" in keys and "single_blocks.0.linear1.weight" in keys


@pytest.mark.numerics  # LAPACK's and the forward pass's kernels: rounding-level results
def test_extract_recovers_the_low_rank_change(tuned, tmp_path, capsys):
    base_dir, tuned_dir, changes = tuned
    out = tmp_path / "x.safetensors"
    assert run("extract", "--base", base_dir, "--tuned", tuned_dir, "--rank", 2, "--format", "diffusers", out,
               "--device", "cpu") == 0
    got = deltas(out)
    assert got.keys() == {f"transformer.{m}" for m in changes}  # unchanged Linears are not in the LoRA
    base = load_file(base_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    tuned_w = load_file(tuned_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    bounds = {}
    for m, d in changes.items():
        stored = tuned_w[f"{m}.weight"].double() - base[f"{m}.weight"].double()
        s = torch.linalg.svdvals(stored)
        n = min(stored.shape)
        bounds[m] = (2 * ((stored - d).norm() + U * stored.norm()).item()  # the files' rounding, and the subtraction's
                     + 2 * rounding(n, magnitude=s[0].item()) + 4 * U * s[:2].sum().item())
        assert (got[f"transformer.{m}"] - d).abs().max().item() <= bounds[m], m
    assert "energy kept" in capsys.readouterr().out

    # single files in diffusers' key layout: the same LoRA (the family names the layout)
    single = tmp_path / "single.safetensors"
    assert run("extract", "--base", base_dir / "transformer" / "diffusion_pytorch_model.safetensors", "--tuned",
               tuned_dir / "transformer" / "diffusion_pytorch_model.safetensors", "--family", "flux", "--rank", 2,
               "--format", "diffusers", single, "--device", "cpu") == 0
    assert all(torch.equal(a, b) for a, b in zip(load_file(single).values(), load_file(out).values()))

    # kohya: Flux's fused Linears (qkv: v untouched; linear1: the mlp slot only); no kohya name: left out
    k = tmp_path / "k.safetensors"
    assert run("extract", "--base", base_dir, "--tuned", tuned_dir, "--rank", 2, k, "--device", "cpu") == 0
    assert "no kohya name" in capsys.readouterr().err
    got = deltas(k)
    assert set(got) == {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_img_mlp_2",
                        "lora_unet_single_blocks_0_linear1"}
    for name, d in got.items():
        rows = kohya_rows_of("flux", base_dir, name)
        want = torch.cat([changes.get(r, torch.zeros(base[f"{r}.weight"].shape, dtype=torch.float64)) for r in rows])
        assert (d - want).abs().max().item() <= max(bounds[r] for r in rows if r in changes), name


def test_into_base_flux_original_layout_reads_back_in_diffusers(tmp_path):
    """FLUX.1's BFL layout, read back by diffusers' from_single_file converter, which assumes FLUX.1's 3072 width
    (and 4x MLP): a bf16 model of that width with one block of each kind (~0.5 B parameters), a LoRA on every
    fused slot (q, k, v, proj_mlp), merged exactly as the diffusers-layout file."""
    from diffusers import FluxPipeline

    small = dict(joint_attention_dim=64, pooled_projection_dim=32, in_channels=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        den = FluxTransformer2DModel(num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=24,
                                     guidance_embeds=True, **small).to(torch.bfloat16)
    model_dir = tmp_path / "model"
    den.save_pretrained(model_dir / "transformer")
    (model_dir / "model_index.json").write_text('{"_class_name": "FluxPipeline", "transformer": ["diffusers", '
                                                '"FluxTransformer2DModel"]}')
    targets = ["to_q", "to_k", "to_v", "proj_mlp", "add_k_proj", "to_out.0"]
    den.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=targets))
    with torch.no_grad():
        for name, p in den.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.full_like(p, 0.01))
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(den))
    lora, plain, original = tmp_path / "pytorch_lora_weights.safetensors", tmp_path / "d.safetensors", tmp_path / "o.safetensors"
    assert run("merge", lora, "--into-base", model_dir, plain) == 0
    assert run("merge", lora, "--into-base", model_dir, "--layout", "original", original) == 0
    keys = load_file(original).keys()
    assert "single_blocks.0.linear1.weight" in keys and "double_blocks.0.img_attn.norm.query_norm.scale" in keys
    back = FluxTransformer2DModel.from_single_file(str(original), config=str(model_dir), subfolder="transformer",
                                                   local_files_only=True, torch_dtype=torch.bfloat16).state_dict()
    want = load_file(plain)
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)
