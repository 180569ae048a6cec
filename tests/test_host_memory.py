"""Issue 43 item 5: the host side of the preflight (tasks/training/host_memory.py). A run whose swapped blocks,
offloaded activations and loading do not fit the RAM is refused before loading, in one line naming a setting
that fits both the device and the host; a truncated model file is refused by validate."""
from __future__ import annotations

import re
import shutil

import pytest

from bench.gpu import FLUX_DEV
from bench.memory import write_headers
from tasks.config import ConfigError, config_of, updated
from tasks.training import host_memory
from tasks.training.memory import estimate


def _cfg(**train):
    return config_of({"model": {"dtype": "bfloat16", "storage_dtype": None, "quantize": "nf4", "max_sequence_length": 512},
            "train": {"rank": 16, "batch_size": 1, "optimizer": "adamw", "mixed_precision": "bf16",
                      "gradient_checkpointing": True, **train}})


def _estimate_for(folder):
    from diffusers import FluxTransformer2DModel

    from tasks.models.flux import FluxAdapter

    def estimate_for(c):
        return estimate(c, folder, "transformer", FluxAdapter.LORA_TARGETS, (1024, 1024), 512,
                        FluxTransformer2DModel, FluxAdapter.swap_blocks, geometry=FluxAdapter.activation_geometry)
    return estimate_for


def test_a_run_the_ram_cannot_hold_is_refused_naming_what_fits(tmp_path):
    folder = write_headers(tmp_path, FLUX_DEV)  # full-size FLUX.1-dev shapes
    estimate_for = _estimate_for(folder)
    cfg = _cfg(blocks_to_swap=50)
    est = {**estimate_for(cfg), "budget_gb": 12.0}
    assert est["host_gb"] > 3  # 50 of 57 blocks' NF4 weights wait on the host
    with pytest.raises(ConfigError) as e:
        host_memory.check(cfg, est, 0.5, 4.0, "available RAM", estimate_for, 57)
    msg = str(e.value)
    assert "\n" not in msg and "host memory" in msg and "4.0 GiB (available RAM)" in msg
    n = int(re.search(r"would fit: train\.blocks_to_swap=(\d+)", msg).group(1))
    fitted = _cfg(blocks_to_swap=n)
    fitted_est = estimate_for(fitted)
    # what it names fits both: the device budget and the host (the same figures check computes)
    assert fitted_est["total_gb"] <= 12.0
    assert host_memory.host_need(fitted, fitted_est, 0.5)["host_need_gb"] <= 4.0
    assert n < 50


def test_a_run_that_fits_reports_its_host_need(tmp_path):
    folder = write_headers(tmp_path, FLUX_DEV)
    estimate_for = _estimate_for(folder)
    cfg = _cfg(blocks_to_swap=10)
    est = {**estimate_for(cfg), "budget_gb": 24.0}
    got = host_memory.check(cfg, est, 0.5, 64.0, "available RAM", estimate_for, 57)
    assert got["host_need_gb"] == pytest.approx(host_memory.PROCESS_GB + est["host_gb"] + 0.5, abs=0)


def test_loading_holds_one_tensor_streamed_and_the_whole_base_for_dora():
    shapes = {"a.weight": [3072, 12288], "b.weight": [64, 64]}
    file_bytes = {"a.weight": 3072 * 12288 * 2, "b.weight": 64 * 64 * 2}
    cfg = _cfg()
    # the largest tensor as read (bf16) and its fp32 copy where a scale is applied: 6 bytes an element
    assert host_memory.loading_gb(cfg, shapes, file_bytes) * host_memory.GB == 3072 * 12288 * 6
    dora = updated(cfg, {"train.network": "dora"})
    assert host_memory.loading_gb(dora, shapes, file_bytes) * host_memory.GB == (3072 * 12288 + 64 * 64) * 2


def test_validate_refuses_a_truncated_model_file_in_one_line(tmp_path):
    from tasks import validate
    from tasks.config import compose, resolve_paths
    from tasks.models import resolve_model
    from tasks.store import Store

    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}"])[0])
    built = resolve_model(cfg.model, Store(tmp_path / "store"))
    local = tmp_path / "model"
    shutil.copytree(built, local)
    file = next((local / "transformer").glob("*.safetensors"))
    file.write_bytes(file.read_bytes()[:-64])
    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}", f"model.path={local}"])[0])
    with pytest.raises(ConfigError, match="truncated") as e:
        validate.run(cfg, Store(tmp_path / "store"))
    assert str(file) in str(e.value) and "download it again" in str(e.value)
