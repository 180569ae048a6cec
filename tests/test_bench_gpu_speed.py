"""bench.gpu_speed (issue 45's figures) runs on the CPU as its smoke test: every setting it names is one the train
node builds (the model.quantize / model.matmul / train.blocks_to_swap paths), and a row records its matmul path.
Timings are the bench's, not asserted here."""
from __future__ import annotations

import json

from bench import gpu_speed


def test_the_speed_bench_runs_its_settings_through_the_train_nodes_code(tmp_path):
    out = tmp_path / "speed.json"
    assert gpu_speed.main(["--tiny", "--only", "int8+w8a8,fp8,int8+w8a8+swap10,nf4+bnb", "--steps", "1", "--warmup",
                           "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["settings"]}
    assert set(rows) == {"bf16", "int8+w8a8", "fp8", "int8+w8a8+swap10", "nf4+bnb"}
    assert all(r["error"] is None and r["step_median_s"] > 0 for r in rows.values()), rows
    assert "w8a8" in rows["int8+w8a8"]["runtime"]["matmul"] and "fallback" in rows["fp8"]["runtime"]["matmul"]
    assert "bnb.matmul_4bit" in rows["nf4+bnb"]["runtime"]["matmul"]  # bitsandbytes' CPU backend runs it here
    assert result["step_flops"] > 0 and {f["name"].split(" step")[0] for f in result["figures"]} >= {"int8+w8a8", "fp8",
                                                                                                      "nf4+bnb"}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"figures": [{"name": "other", "value": 1.0}]}))
    gpu_speed.merge(out, results)
    names = [f["name"] for f in json.loads(results.read_text())["figures"]]
    assert names[0] == "other" and len(names) == 1 + len(result["figures"])


def test_a_run_past_its_budget_keeps_what_it_measured(tmp_path):
    """--budget: no setting starts after it but bf16's re-run (the drift); the JSON holds the rows measured."""
    out = tmp_path / "speed.json"
    assert gpu_speed.main(["--tiny", "--only", "fp8,int8", "--steps", "1", "--warmup", "0", "--budget", "1e-9",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["settings"]] == ["bf16"] and result["settings"][0]["again_step_median_s"] > 0
