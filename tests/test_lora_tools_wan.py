"""loraflow-lora on Wan files (tasks/lora_tools): Wan 2.2's files have one expert's layout (`transformer.*` in
diffusers, musubi-tuner's names in kohya) whichever expert they were trained on; resize, convert and merge keep it;
a Wan 2.2 folder is told from a Wan 2.1 one (both WanPipeline) by its second expert; merge --into-base and extract
take `--expert high|low` there and refuse to guess. LTX-2's files convert and merge too. Tolerances: tests/test_lora_tools.py's (float32 unit roundoff
u: a folded scale moves a delta by u * |s| * (|up| @ |down|); a merged weight is one float32 rounding of a float64
sum; an SVD of a rank-2 change keeps it to its files' rounding)."""
from __future__ import annotations

import shutil

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from safetensors.torch import load_file, save_file

from tasks.lora_tools.models import pipeline_family
from tasks.models.tiny.tiny_wan import build_tiny_wan, build_tiny_wan22
from tasks.models.wan import WanAdapter
from tasks.training.export import kohya_metadata, save_kohya
from lora_fixtures import factors_and_deltas, random_lora
from lora_tools_checks import U, assert_deltas, deltas, fold_bound, run

RANK, ALPHA = 4, 3.0
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    return build_tiny_wan22(tmp_path_factory.mktemp("wan22") / "model")


@pytest.fixture(scope="module")
def files(wan22, tmp_path_factory):
    """A low-expert LoRA as loraflow writes it (diffusers `transformer.*`, kohya with musubi-tuner's names) and
    its float64 deltas."""
    out = tmp_path_factory.mktemp("lora")
    den = WanTransformer3DModel.from_pretrained(wan22, subfolder="transformer_2")
    sd, config = random_lora(den, WanAdapter.LORA_TARGETS, RANK, ALPHA)
    WanPipeline.save_lora_weights(out, transformer_lora_layers=sd, transformer_lora_adapter_metadata=config.to_dict())
    save_kohya(out / "lora_kohya.safetensors", "wan22", sd, RANK, ALPHA, kohya_metadata("wan22", RANK, ALPHA))
    factors, ref = factors_and_deltas(sd, RANK, ALPHA)
    return out, ref, factors


def test_a_wan22_folder_is_told_from_a_wan21_one(wan22, tmp_path):
    assert pipeline_family(wan22, "x") == "wan22"
    assert pipeline_family(build_tiny_wan(tmp_path / "wan21"), "x") == "wan"


def test_files_keep_one_experts_layout_through_the_tools(files, tmp_path):
    out, ref, factors = files
    conv = tmp_path / "conv.safetensors"
    assert run("convert", "--format", "diffusers", out / "lora_kohya.safetensors", conv) == 0
    assert_deltas(deltas(conv), ref, fold_bound(factors), "kohya -> diffusers")  # `transformer.*`, every module
    merged = tmp_path / "merged.safetensors"
    assert run("merge", "--weights", "0.5,0.5", out / "pytorch_lora_weights.safetensors", out / "lora_kohya.safetensors",
               merged) == 0
    got = deltas(merged)  # the same 20 modules, each at 0.5 + 0.5 of the delta
    assert_deltas(got, ref, {m: 2 * b for m, b in fold_bound(factors).items()}, "merge")
    small = tmp_path / "r.safetensors"
    assert run("resize", "--rank", RANK, out / "pytorch_lora_weights.safetensors", small) == 0
    assert set(deltas(small)) == set(ref)


def test_into_base_takes_the_expert_it_is_told(wan22, files, tmp_path, capsys):
    out, ref, _ = files
    merged = tmp_path / "low.safetensors"
    assert run("merge", out / "lora_kohya.safetensors", "--into-base", wan22, merged) == 2
    err = capsys.readouterr().err
    assert "pass --expert high or --expert low" in err and err.count("\n") == 1 and not merged.exists()
    assert run("merge", out / "lora_kohya.safetensors", "--into-base", wan22, "--expert", "low", merged) == 0
    base, got = load_file(wan22 / "transformer_2" / WEIGHTS), load_file(merged)
    assert got.keys() == base.keys()
    for k, v in base.items():
        m = f"transformer.{k[: -len('.weight')]}"
        if m not in ref:
            assert torch.equal(got[k], v), k
            continue
        exact = v.double() + ref[m]
        assert ((got[k].double() - exact).abs() <= 2 * U * exact.abs()).all(), k
    assert run("merge", out / "lora_kohya.safetensors", "--weights", "1", "--expert", "low", tmp_path / "x.safetensors") == 2


def test_extract_from_one_expert(wan22, tmp_path, capsys):
    tuned = tmp_path / "tuned"
    shutil.copytree(wan22, tuned)
    file = tuned / "transformer_2" / WEIGHTS
    weights, m = load_file(file), "blocks.0.attn1.to_q"
    w = weights[f"{m}.weight"]
    gen = torch.Generator().manual_seed(3)
    d = 0.05 * (torch.randn(w.shape[0], 2, generator=gen, dtype=torch.float64)
                @ torch.randn(2, w.shape[1], generator=gen, dtype=torch.float64))
    weights[f"{m}.weight"] = (w.double() + d).to(torch.float32)
    save_file(weights, file)
    out = tmp_path / "x.safetensors"
    assert run("extract", "--base", wan22, "--tuned", tuned, "--expert", "low", "--rank", 2, "--format",
               "diffusers", out, "--device", "cpu") == 0
    got = deltas(out)
    stored = weights[f"{m}.weight"].double() - w.double()
    assert set(got) == {f"transformer.{m}"}
    assert (got[f"transformer.{m}"] - d).abs().max() <= 2 * (stored - d).norm() + 8 * U * torch.linalg.svdvals(stored)[:2].sum()
    capsys.readouterr()
    assert run("extract", "--base", wan22, "--tuned", tuned, "--expert", "high", "--rank", 2, tmp_path / "y.safetensors",
               "--device", "cpu") == 2  # the high expert is unchanged
    assert "nothing to extract" in capsys.readouterr().err


def test_ltx2_files_round_trip_and_merge_into_the_base(tmp_path):
    """LTX-2's kohya file (diffusers' names, as LTX-2's own code has them) converts to the diffusers file's deltas
    and merges into the transformer's weights."""
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    from tasks.models.ltx2 import LTX2Adapter
    from tasks.models.tiny.tiny_ltx2 import build_tiny_ltx2

    model = build_tiny_ltx2(tmp_path / "ltx2")
    den = LTX2VideoTransformer3DModel.from_pretrained(model, subfolder="transformer")
    sd, config = random_lora(den, LTX2Adapter.LORA_TARGETS, RANK, ALPHA)
    LTX2Pipeline.save_lora_weights(tmp_path, transformer_lora_layers=sd, transformer_lora_adapter_metadata=config.to_dict())
    save_kohya(tmp_path / "lora_kohya.safetensors", "ltx2", sd, RANK, ALPHA, kohya_metadata("ltx2", RANK, ALPHA))
    factors, ref = factors_and_deltas(sd, RANK, ALPHA)
    conv = tmp_path / "conv.safetensors"
    assert run("convert", "--format", "diffusers", tmp_path / "lora_kohya.safetensors", conv) == 0
    assert_deltas(deltas(conv), ref, fold_bound(factors), "ltx2 kohya -> diffusers")
    assert_deltas(deltas(tmp_path / "pytorch_lora_weights.safetensors"), ref, fold_bound(factors), "ltx2 diffusers")
    merged = tmp_path / "merged.safetensors"
    assert run("merge", tmp_path / "lora_kohya.safetensors", "--into-base", model, merged) == 0
    base, got = load_file(model / "transformer" / WEIGHTS), load_file(merged)
    for m, d in ref.items():
        k = f"{m.removeprefix('transformer.')}.weight"
        exact = base[k].double() + d
        assert ((got[k].double() - exact).abs() <= 2 * U * exact.abs()).all(), k
