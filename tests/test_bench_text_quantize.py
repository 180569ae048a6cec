"""bench.text_quantize (how far text.quantize moves the embeddings) and bench.load's text rows (issue 61), on tiny
encoders: the code paths the full-size runs take, in seconds."""
import json
import math

import pytest
import torch
from safetensors import safe_open

import bench.text_encoder_configs as tec
from bench import load
from bench.text_quantize import drift, measure_real, measure_tiny

# a Mistral 3 (FLUX.2 [dev]'s encoder class) a few hundred kB large: transformers renames its checkpoint keys
_SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=None)
_TINY_MISTRAL3 = ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
    text_config=dict(model_type="mistral", **_SMALL),
    vision_config=dict(model_type="pixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=2, head_dim=32, image_size=56, patch_size=14),
    image_token_index=10, spatial_merge_size=2, projector_hidden_act="gelu", multimodal_projector_bias=False,
    vision_feature_layer=-1, tie_word_embeddings=False))


def _check(rows, kinds):
    assert {r["quantize"] for r in rows} == set(kinds)
    for r in rows:
        assert math.isfinite(r["rel_l2"]) and r["rel_l2"] >= 0, r
        assert -1 <= r["min_cosine"] <= r["cosine"] <= 1, r
        if r["quantize"] == "none":  # the streamed bf16 encoder is the reference, bit for bit
            assert r["rel_l2"] == 0 and r["cosine"] == pytest.approx(1, abs=1e-6), r
        else:
            assert 0 < r["rel_l2"] < 1 and r["cosine"] > 0.5, r


def test_drift_of_a_tensor_with_itself_and_its_negative():
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    assert drift(x, x)["rel_l2"] == 0 and drift(x, x)["cosine"] == pytest.approx(1, abs=1e-6)
    assert drift(x, -x)["rel_l2"] == pytest.approx(2) and drift(x, -x)["min_cosine"] == pytest.approx(-1, abs=1e-6)
    x[0, 0] = 0  # a zero (padded) reference token counts in L2, not in the cosines
    assert drift(x, x)["tokens"] == 9


def test_tiny_family_drift_per_quantize(tmp_path):
    rows = measure_tiny("flux", kinds=("none", "nf4"), work=tmp_path)
    assert {r["output"] for r in rows} == {"prompt_embeds", "pooled_prompt_embeds"}  # what the cache stores
    _check(rows, ("none", "nf4"))


def test_real_architecture_drift_at_reduced_depth(tmp_path):
    rows = measure_real("byt5_small", kinds=("none", "int8"), work=tmp_path, depth=1)
    assert all(r["depth"] == 1 and r["output"] == "last_hidden_state" for r in rows)
    _check(rows, ("none", "int8"))
    assert not list(tmp_path.iterdir())  # the saved encoder is removed


@pytest.fixture
def tiny_text(monkeypatch):
    monkeypatch.setitem(tec._CONFIGS, "mistral3_tiny", _TINY_MISTRAL3)
    monkeypatch.setitem(load.TEXT, "tiny_text", "mistral3_tiny")
    monkeypatch.setattr(load, "CHUNK", 1000)  # the embedding drawn in parts, as the real ones are
    return "tiny_text"


def test_text_model_written_in_the_hub_layout_and_loaded_per_quantize(tiny_text, tmp_path):
    folder = load.write_text_model(tiny_text, tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "language_model.model.embed_tokens.weight" in index["weight_map"]  # save_pretrained's names, not the model's
    with safe_open(folder / next(iter(index["weight_map"].values())), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    rows = {k: load.run_text_row(tiny_text, k, tmp_path) for k in ("none", "nf4")}
    # the checkpoint less its output head (cache_text drops it: text_load.TextLoading.head), plus rope buffers
    head = tec.build("mistral3_tiny").get_output_embeddings().weight.numel() * 2 / load.GIB
    assert rows["none"]["quantized_weights_gib"] == pytest.approx(rows["none"]["checkpoint_gib"] - head, rel=0.01)
    assert rows["nf4"]["quantized_weights_gib"] < 0.7 * rows["none"]["quantized_weights_gib"]
    for kind, r in rows.items():
        assert r["name"] == f"tiny_text:{kind}" and r["path"] == "stream" and r["peak_rss_gib"] > 0
        assert r["quantized_weights_gib"] == pytest.approx(load.text_stored_estimate(tiny_text, kind) / load.GIB,
                                                           rel=0.05)


# bench.load's main with the tiny encoder, each row in the process itself, in a fresh process: a row's peak RSS is
# the process's high-water mark (VmHWM), which in a test worker is whatever the tests before it reached (4.24 GiB
# in a clean run of 2026-11-29, against the row's 2 GiB goal)
_MAIN = """import json, sys
import bench.text_encoder_configs as tec
from bench import load
tec._CONFIGS["mistral3_tiny"] = tuple(json.loads(sys.argv[1]))
load.TEXT["tiny_text"] = "mistral3_tiny"
load.CHUNK = 1000
load.guarded = lambda name, kind, path, root, timeout=None: load.run_text_row(name, kind, root)
sys.exit(load.main(sys.argv[2:]))
"""


def test_text_rows_merged_into_the_json_and_too_big_ones_recorded_as_needs(tiny_text, tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "load.json"
    out.write_text(json.dumps({"rows": [{"name": "flux_dev:nf4", "path": "stream", "peak_rss_gib": 11.07}]}))
    proc = subprocess.run([sys.executable, "-c", _MAIN, json.dumps(_TINY_MISTRAL3), "--models", tiny_text, "--only",
                           "nf4,none", "--dir", str(tmp_path / "models"), "--out", str(out)],
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    monkeypatch.setattr(load, "guarded", lambda name, kind, path, root, timeout=None: load.run_text_row(name, kind, root))
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"flux_dev:nf4", "tiny_text:nf4", "tiny_text:none"}  # earlier rows kept
    assert rows["tiny_text:nf4"]["meets"] and rows["tiny_text:nf4"]["goal_gib"] > 2
    # a machine too small for the bf16 encoder: `none` states what it needs instead of running
    monkeypatch.setattr(load, "_status_total", lambda: 2 * load.GIB + 1)
    monkeypatch.setattr(load, "text_stored_estimate", lambda name, kind: 2 if kind == "none" else 1)
    got = []
    load._text_rows(tiny_text, ["nf4", "none"], tmp_path / "models", None, lambda r, k: got.append(r))
    assert "status" not in got[0] and got[1]["status"].startswith("not run") and got[1]["needs_host_gib"] > 0
    # a shared machine whose other work holds the memory now: not run either, and it says so
    monkeypatch.setattr(load, "_available", lambda: load.GIB)
    got = []
    load._text_rows(tiny_text, ["nf4"], tmp_path / "models", None, lambda r, k: got.append(r))
    assert got[0]["status"].startswith("not run") and "available" in got[0]["status"]
