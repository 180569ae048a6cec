"""bench.memory: its fake-tensor count of saved activations equals a real CPU run's, and the preflight estimate
stays within 10 % of the committed measurements (bench/memory.json) for every configuration."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu import FLUX_DEV, TINY
from bench.memory import CONFIGS, measure, preflight, write_headers
from tolerance import PREFLIGHT_WITHIN

MEASURED = Path(__file__).resolve().parents[1] / "bench" / "memory.json"
SMALL = dict(TINY, attention_head_dim=32, joint_attention_dim=96, axes_dims_rope=(8, 12, 12))  # reduced width
GIB = 1 << 30


@pytest.mark.parametrize("name,fp8,ckpt,modulation", CONFIGS)
def test_fake_tensors_count_the_bytes_a_real_cpu_run_saves(name, fp8, ckpt, modulation):
    """Same code path, 64 image + 16 text tokens: the meta-backed fake run and a real one save equal bytes."""
    real = measure(SMALL, 128, 16, fp8, ckpt, modulation, rank=4, fake=False)
    fake = measure(SMALL, 128, 16, fp8, ckpt, modulation, rank=4, fake=True)
    assert fake == real
    assert real["saved_bytes"] > 0 and (real["recompute_bytes"] > 0) == ckpt


def test_checkpointing_holds_block_inputs_plus_one_recompute():
    plain = measure(SMALL, 128, 16, False, False, False, rank=4)
    ckpt = measure(SMALL, 128, 16, False, True, False, rank=4)
    assert ckpt["saved_bytes"] < plain["saved_bytes"] / 2
    assert ckpt["recompute_bytes"] < plain["saved_bytes"]


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    return write_headers(tmp_path_factory.mktemp("flux-dev"), FLUX_DEV)


def test_the_committed_figures_are_what_the_code_measures():
    """fp8+ckpt at 512 px on the full-size model (fake tensors: seconds, no memory) against bench/memory.json."""
    row = next(r for r in json.loads(MEASURED.read_text())["configs"] if r["name"] == "fp8+ckpt@512")
    m = measure(FLUX_DEV, 512, row["text_tokens"], True, True, False, row["rank"])
    assert m["activation_bytes"] / GIB == row["activations_gib"]  # byte counts: integers, one division, JSON keeps it
    assert m["weights_bytes"] / GIB == row["weights_gib"]


def test_preflight_estimate_within_10_percent_of_measured(flux_dev):
    rows = [r for r in json.loads(MEASURED.read_text())["configs"] if ":" not in r["name"]]  # FLUX.1-dev's own
    assert {c[0] for c in CONFIGS} <= {r["name"] for r in rows}
    for r in rows:
        est = preflight(flux_dev, r["resolution"], r["text_tokens"], r["fp8"], r["checkpointing"],
                        r["modulation_fp8"], r["rank"])
        # the total against the live peak (bench/memory_peak.py): since issue 43 the preflight counts the
        # transients a GPU's peak holds, which measured_gib (what is held) leaves out
        assert est["total_gb"] == pytest.approx(r["peak_gib"], rel=PREFLIGHT_WITHIN), r["name"]
        assert est["activations_gb"] == pytest.approx(r["activations_gib"], rel=PREFLIGHT_WITHIN), r["name"]
        assert est["weights_gb"] == r["weights_gib"], r["name"]  # the same integer count, divided alike


def test_big_base_rows_meet_their_goals_and_the_preflight_holds(tmp_path):
    """bench/memory.json's `<model>:<options>` rows (bench/memory_families.py): the preflight as the code computes
    it now is the recorded one and within 10 % of the live peak (peak_gib: what a GPU's max_memory_allocated
    shows, transients included, issue 43); each model has a row under its goal."""
    from bench import memory_families

    rows = [r for r in json.loads(MEASURED.read_text())["configs"] if r["name"].count(":") == 1]  # node rows: two
    assert {r["name"] for r in rows if "+fsdp" not in r["name"]} == set(memory_families.ROWS)  # sharded: test_shard_memory
    for r in rows:
        est = memory_families.preflight(r["name"], tmp_path, r["resolution"], r["text_tokens"], r["rank"])
        assert est["total_gb"] == pytest.approx(r["preflight_gib"], rel=1e-12), r["name"]  # same sums, same order
        assert est["host_gb"] == pytest.approx(r["host_gib"], rel=0.01), r["name"]  # NF4/int8: formula vs torchao
        assert r["preflight_gib"] == pytest.approx(r["peak_gib"], rel=PREFLIGHT_WITHIN), r["name"]
    for model, limit in memory_families.GOALS.items():
        assert any(r["measured_gib"] <= limit for r in rows if r["name"].startswith(model + ":")), model


# Issue 47 item 5: the image-to-video models' rows and card-table settings
I2V_MODELS = (("wan21_i2v_14b", (832, 480), 81, 16.39e9), ("wan22_i2v_a14b", (832, 480), 81, 14.29e9),
              ("wan22_ti2v_5b", (1280, 704), 121, 5.00e9))
I2V_CARD_KEYS = ("wan21_i2v_14b", "wan21_i2v_14b_33f", "wan22_i2v_a14b", "wan22_ti2v_5b", "wan22_ti2v_5b_49f")


@pytest.mark.parametrize("model,size,frames,params", I2V_MODELS)
def test_image_to_video_rows_at_the_model_cards_sizes(model, size, frames, params, tmp_path):
    """Wan 2.1 I2V-14B and a Wan 2.2 I2V-A14B expert at 480x832, 81 frames, TI2V-5B at 704x1280, 121 frames: rows
    `<model>:<options>` in bench/memory.json with measured_gib, preflight_gib and host_gib; the preflight of each, run
    here on the CPU from the real config's headers, is the recorded one and within 10 % of the row's live peak."""
    from bench import memory_families
    from bench.family_models import geometry

    assert geometry(model, 1024) == (size, frames)
    rows = {r["name"]: r for r in json.loads(MEASURED.read_text())["configs"]}
    names = [n for n in memory_families.ROWS if n.startswith(model + ":")]
    assert len(names) >= 2 and all(n in rows for n in names)
    for name in names:
        r = rows[name]
        assert {"measured_gib", "preflight_gib", "host_gib", "peak_gib"} <= r.keys()
        assert (tuple(r["size"]), r["frames"]) == (size, frames)
        est = memory_families.preflight(name, tmp_path)
        assert est["params"] == pytest.approx(params, rel=2e-3)  # the real transformer's size
        assert est["total_gb"] == pytest.approx(r["preflight_gib"], rel=1e-12), name
        assert est["total_gb"] == pytest.approx(r["peak_gib"], rel=PREFLIGHT_WITHIN), name
        assert est["host_gb"] == pytest.approx(r["host_gib"], rel=0.01), name


def test_the_card_table_names_image_to_video_settings_that_fit(tmp_path):
    """The 12/16/24 GB train settings of the image-to-video models in bench/memory.json (`train_cards`; `cards` is the
    whole run's since issue 61, tests/test_run_memory.py) are what the preflight picks now (on the CPU), and each is a
    bench.memory row whose live peak leaves the CUDA context (0.5 GiB) free on the card. Nothing fits 12 or 16 GB at
    81 frames (480x832) for the 14B models, nor 12 GB for TI2V-5B at 121; the whole run fits there neither."""
    from bench import memory_families

    doc = json.loads(MEASURED.read_text())
    rows = {r["name"]: r for r in doc["configs"]}
    for key, model, copies in memory_families.CARD_ROWS:
        if "i2v" not in key:
            continue
        for card in (12, 16, 24):
            pick = memory_families.advice(model, tmp_path, card, copies=copies)
            assert doc["train_cards"][key][str(card)] == pick, (key, card)
            if key in I2V_CARD_KEYS and pick != "does not fit":
                row = rows[f"{model}:{pick.split(' (')[0]}"]
                assert row["peak_gib"] <= card * 1e9 / GIB - 0.5, (key, card)
                run = doc["run_cards"][key][str(card)]  # the whole run: this train setting, or another node stuck
                assert run["stuck"] != "train" if run["setting"] is None else \
                    run["setting"]["train"] == pick.split(" (")[0], (key, card)
    for k, c in [(k, c) for k in ("wan21_i2v_14b", "wan22_i2v_a14b") for c in ("12", "16")] + [("wan22_ti2v_5b", "12")]:
        assert doc["train_cards"][k][c] == "does not fit" and doc["cards"][k][c].startswith("does not fit"), (k, c)


def test_the_gpu_rows_run_on_the_cpu_at_a_tiny_size(monkeypatch):
    """bench.memory_gpu's step (what a lent GPU runs for these rows) on the CPU: each image-to-video model at a tiny
    width with its own inputs, an NF4 / int8 base, checkpointing with its offload and a swapped block."""
    import torch

    from bench import family_models, memory_gpu

    tiny = dict(num_attention_heads=2, attention_head_dim=32, ffn_dim=128, num_layers=2, text_dim=64, freq_dim=32,
                rope_max_seq_len=64)
    table = family_models.model_table()
    archs = {"wan21_i2v_14b": dict(tiny, in_channels=36, image_dim=64, added_kv_proj_dim=64),
             "wan22_i2v_a14b": dict(tiny, in_channels=36),
             "wan22_ti2v_5b": dict(tiny, in_channels=48, out_channels=48, patch_size=(1, 2, 2))}
    monkeypatch.setattr(family_models, "model_table",
                        lambda: {**table, **{m: (table[m][0], table[m][1], a) for m, a in archs.items()}})
    monkeypatch.setitem(family_models.GEOMETRY, "wan21_i2v_14b", ((64, 32), 5))
    monkeypatch.setitem(family_models.GEOMETRY, "wan22_i2v_a14b", ((64, 32), 5))
    monkeypatch.setitem(family_models.GEOMETRY, "wan22_ti2v_5b", ((64, 64), 5))
    for name in ("wan21_i2v_14b:nf4+ckpt+offload+swap1", "wan22_i2v_a14b:int8+ckpt", "wan22_ti2v_5b:nf4+ckpt+offload+swap1"):
        out = memory_gpu.measure(name, steps=2, device=torch.device("cpu"))
        assert out["error"] is None, out.get("traceback")
        assert len(out["step_s"]) == 2 and out["matmul"]


def test_gpu_figures_merge_into_the_rows_by_name(tmp_path):
    from bench import memory_gpu

    memory = tmp_path / "memory.json"
    memory.write_text(MEASURED.read_text())
    name = "wan22_ti2v_5b:nf4+ckpt"
    (tmp_path / "gpu.json").write_text(json.dumps({"device": "NVIDIA H100", "date": "d", "rows": [
        {"name": name, "gpu_peak_gib": 20.0, "gpu_reserved_gib": 21.0, "step_median_s": 9.0, "error": None},
        {"name": "wan21_i2v_14b:nf4+ckpt", "gpu_peak_gib": 1.0, "error": "OutOfMemoryError: ..."}]}))
    memory_gpu.merge(tmp_path / "gpu.json", memory)
    rows = {r["name"]: r for r in json.loads(memory.read_text())["configs"]}
    assert rows[name]["gpu_peak_gib"] == 20.0 and rows[name]["gpu_device"] == "NVIDIA H100"
    assert rows[name]["gpu_preflight_error"] == pytest.approx(rows[name]["preflight_gib"] / 20.0 - 1)
    assert "gpu_peak_gib" not in rows["wan21_i2v_14b:nf4+ckpt"]  # a failed row merges nothing
