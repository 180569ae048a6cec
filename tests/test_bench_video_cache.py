"""bench/video_cache.py on a tiny setting (2 short clips, tiny_wan's own VAE, 1 round): what it reports and that
its two sides encode the same thing. Behaviour only, never timings."""
from __future__ import annotations

import json
import os

import torch

from bench import compute, video_cache
from tasks import cache_latents

FRAMES, SIZE = 5, 32


def test_ours_and_bare_same_latents_and_report(tmp_path):
    clips = video_cache.make_clips(tmp_path / "data", 2, FRAMES, SIZE, fps=8.0)
    assert all(p.with_suffix(".txt").is_file() for p in clips)
    cfg = video_cache.video_cfg(tmp_path / "data", tmp_path / "store", FRAMES, SIZE, {})
    plan, store = compute.plan_for(cfg)
    assert [it["clip"] for it in plan.items] == [{"frames": FRAMES, "fps": 8.0}] * 2

    res = video_cache.bench_video_latents(cfg, plan, store, tmp_path, reps=1)
    keys = ("clips", "frames", "size", "reps", "ours_s", "bare_s", "ours_median", "bare_median", "ratio", "cpu_ratio")
    assert set(keys) <= set(res), set(keys) - set(res)
    assert (res["clips"], res["frames"], res["size"], res["reps"]) == (2, FRAMES, [SIZE, SIZE], 1)
    assert len(res["ours_s"]) == len(res["bare_s"]) == len(res["ours_cpu_s"]) == len(res["bare_cpu_s"]) == 1
    assert res["ratio"] == res["bare_median"] / res["ours_median"]
    assert not (tmp_path / "bare_latents").exists()  # the bare side's files are removed after each round

    # Exactly equal: the same VAE weights run on the same pixels (same decode, resize, [-1, 1] scaling, one clip
    # at a time) in the same process with the same threads, so the same kernels give the same bytes.
    names = [it["name"] for it in plan.items]
    ours = [store.get_tensors(cache_latents.KIND, res["latent_keys"][n])["latents"] for n in names]
    bare = video_cache.bare_latents(plan.model_dir, [it["image"] for it in plan.items], FRAMES, plan.size,
                                    cfg.model.dtype, out=tmp_path)
    assert [z.shape for z in ours] == [torch.Size([16, 1 + (FRAMES - 1) // 4, SIZE // 8, SIZE // 8])] * 2
    for a, b in zip(ours, bare):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], ours[1])  # distinct clips
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["0.safetensors", "1.safetensors"]


def test_main_writes_the_json(tmp_path, monkeypatch):
    # main() points Prefect and HF at its temporary folder (bench.run._env): restored after the test
    for k in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "PREFECT_API_URL", "HF_HUB_OFFLINE",
              "TOKENIZERS_PARALLELISM", "PREFECT_SERVER_ANALYTICS_ENABLED"):
        monkeypatch.setenv(k, os.environ[k]) if k in os.environ else monkeypatch.delenv(k, raising=False)
    out = tmp_path / "video_cache.json"
    assert video_cache.main(["--clips", "2", "--frames", str(FRAMES), "--size", str(SIZE), "--reps", "1",
                             "--tiny-vae", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    keys = ("clips", "frames", "size", "reps", "ours_s", "bare_s", "ours_median", "bare_median", "ratio", "machine")
    assert set(keys) <= set(res), set(keys) - set(res)
    assert (res["clips"], res["frames"], res["size"], res["reps"], res["vae_arch"]) == (2, FRAMES, [SIZE, SIZE], 1, {})
    assert "latent_keys" not in res and res["machine"]["cpu_count"] == os.cpu_count()
