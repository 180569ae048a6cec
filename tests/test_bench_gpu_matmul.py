"""bench.gpu_matmul (issue 45: where model.matmul's time goes on a GPU) runs on the CPU as its smoke test: every
case is a call the train node makes (w8a8's functions, the fallback's upcast) and is recorded, timed or as an error
naming the kernel this machine lacks. Timings are the bench's, not asserted here."""
from __future__ import annotations

import json

from bench import gpu_matmul


def test_the_matmul_bench_records_every_case(tmp_path):
    out = tmp_path / "matmul.json"
    assert gpu_matmul.main(["--tiny", "--eager", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"bf16 forward", "w8a8.int8_linear", "w8a8.fp8_grad_input", "fp8 weight upcast to bf16 (GB/s)",
            "fallback int8 forward (dequantize + bf16)"} <= set(rows)
    assert all("s" in r or r["error"] for r in rows.values())
    ours = [r for name, r in rows.items() if name.startswith(("w8a8.", "fallback", "bf16"))]
    assert all(r.get("error") is None and r["s"] > 0 for r in ours), ours  # loraflow's own paths run here
    assert rows["fp8 weight upcast to bf16 (GB/s)"]["gbps"] > 0
