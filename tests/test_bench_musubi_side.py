"""bench.musubi_side (issue 45 item 4) runs on the CPU as its smoke test: musubi-tuner's own Qwen-Image step (bf16,
`--blocks_to_swap`, `--fp8_base`) beside loraflow's on a tiny DiT, every unit without error, both LoRAs on the same
modules, and its figures named for the contract. Timings are the bench's, not asserted here. It runs in a child
process: musubi's modules set up logging and sys.path on import, and accelerate's state is process-wide."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


from bench import musubi_settings, musubi_side

REPO = musubi_settings.HERE.parent


def test_musubi_and_loraflow_train_the_same_tiny_qwen_image_per_setting(tmp_path):
    if not (musubi_settings.MUSUBI_SRC / "musubi_tuner").is_dir():
        # not in the repository: musubi-tuner's hunyuan_model/ follows Tencent's HunyuanVideo license, not Apache-2.0
        pytest.skip(f"{musubi_settings.MUSUBI_SRC.parent} is absent: `bash bench/musubi_source.sh` fetches musubi-tuner")
    out = tmp_path / "musubi_side.json"
    run = subprocess.run([sys.executable, "-m", "bench.musubi_side", "--tiny", "--settings", "bf16,swap1,fp8",
                          "--rounds", "1", "--steps", "1", "--warmup", "0", "--out", str(out)],
                         cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["family"] == "qwenimage" and result["musubi_commit"] == musubi_settings.MUSUBI_COMMIT
    assert result["complete"]
    rows = {(r["setting"], r["trainer"]): r for r in result["rows"]}
    assert set(rows) == {(s, t) for s in ("bf16", "swap1", "fp8") for t in ("musubi", "loraflow")}
    assert all(r["error"] is None and r["step_s"] > 0 and r["flops"] > 0 for r in rows.values()), rows
    for s in ("bf16", "swap1", "fp8"):  # the same LoRA modules at the same rank (musubi's defaults)
        assert rows[s, "musubi"]["lora_params"] == rows[s, "loraflow"]["lora_params"] > 0
    assert rows["fp8", "musubi"]["musubi_flags"] == "--fp8_base"
    assert rows["swap1", "musubi"]["musubi_flags"] == "--blocks_to_swap 1"
    assert "model.quantize=fp8" in rows["fp8", "loraflow"]["loraflow_overrides"]
    assert rows["swap1", "loraflow"]["loraflow_overrides"] == "train.blocks_to_swap=1"
    figures = result["figures"]
    assert len(figures) == 3 and all("musubi-tuner" in f["name"] and f["unit"] == "x" and f["goal"] == "<= 1.0"
                                     and f["value"] > 0 and isinstance(f["meets"], bool) for f in figures), figures


def test_without_musubis_source_it_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(musubi_settings, "MUSUBI_SRC", tmp_path / ".musubi" / "src")
    assert musubi_side.main(["--tiny"]) == 2
    assert "bash bench/musubi_source.sh" in capsys.readouterr().err
