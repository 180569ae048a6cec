"""bench/host_memory.py (issue 32) on a small model: the fill and the three measurements each in their own process
(about 25 s on 2 cores). Behaviour only, no figures: train ran from the caches without loading the VAE or the
text encoders, and keeping them resident shows in the peak."""
from __future__ import annotations

from bench import host_memory


def test_host_memory_bench_on_a_small_model(tmp_path):
    result = host_memory.run_bench(tmp_path, host_memory.SMALL_ARCH, steps=2)
    assert {"family", "arch", "components_mib", "peak_rss_mib", "train_minus_imports_mib",
            "encoders_would_add_mib"} <= set(result)
    assert set(result["peak_rss_mib"]) == set(host_memory.MODES)
    assert {"vae", "text_encoder", "text_encoder_2", "transformer"} == set(result["components_mib"])
    assert result["trained"] == {"imports": 0, "train": 1, "train+encoders": 1}  # a new LoRA in each train run
    for calls in result["loads_during_train"].values():
        assert calls == {"load_vae": 0, "load_text_encoders": 0}
    peak, weights = result["peak_rss_mib"], result["components_mib"]
    encoders = weights["vae"] + weights["text_encoder"] + weights["text_encoder_2"]
    assert peak["imports"] < peak["train"] < peak["train+encoders"]
    assert result["encoders_would_add_mib"] > encoders / 2  # the held encoders show; without them they are absent
    assert "train+encoders" in host_memory.table(result)
