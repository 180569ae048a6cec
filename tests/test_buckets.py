"""Aspect-ratio buckets: each image trains at the bucket nearest its aspect, each batch from one bucket,
the bucket size part of the latent key (square images keep theirs)."""
from __future__ import annotations

from PIL import Image

from tasks.data.sizes import bucket_sizes, nearest_bucket
from tasks.train import batch_at

WIDE, TALL = ["img_00.png", "img_01.png", "img_02.png", "img_03.png"], ["img_04.png", "img_05.png"]


def test_buckets_keep_area_and_aspect():
    buckets = bucket_sizes(1024, 1024, 64)
    assert (1024, 1024) in buckets and all(b[0] % 64 == 0 and b[1] % 64 == 0 for b in buckets)
    assert all(0.8 < w * h / 1024 ** 2 < 1.25 for w, h in buckets)
    assert nearest_bucket(3000, 2000, buckets) == (1216, 832)  # 3:2 -> kohya's 1216x832
    assert nearest_bucket(2000, 3000, buckets) == (832, 1216)
    assert nearest_bucket(500, 500, buckets) == (1024, 1024)


def test_batches_never_mix_buckets_and_cover_each_epoch():
    groups = [[0, 1, 2, 3, 4], [5, 6], [7, 8, 9]]
    per_epoch = 2 + 1 + 1  # batch size 3: 5 -> 3+2, 2 -> 2, 3 -> 3
    for epoch in range(3):
        seen = [batch_at(epoch * per_epoch + s, groups, 3, seed=1) for s in range(1, per_epoch + 1)]
        assert sorted(i for b in seen for i in b) == list(range(10))
        assert all(any(set(b) <= set(g) for g in groups) for b in seen)
    assert batch_at(4, groups, 3, 1) == batch_at(4, groups, 3, 1)  # stateless: a resumed run agrees


def test_bucketed_training(workspace):
    for name, size in [*((n, (96, 64)) for n in WIDE), *((n, (64, 96)) for n in TALL)]:
        path = workspace.data / name
        Image.open(path).resize(size).save(path)
    plain = workspace.run()
    assert plain["nodes"]["cache_latents"]["computed"] == 6  # the resized images' bytes changed
    bucketed = workspace.run("data.buckets=true")
    latents = bucketed["nodes"]["cache_latents"]
    # Only the non-square images get a new size (and key); the square ones keep 64x64 and are reused.
    assert (latents["computed"], latents["reused"]) == (6, 6)
    assert sum(c.startswith("size:") for c in latents["changed"]) == 12
    assert bucketed["nodes"]["train"]["status"] == "ran" and len(bucketed["artifacts"]["samples"]) == 3
    again = workspace.run("data.buckets=true")
    assert again["nodes"]["cache_latents"]["computed"] == 0 and again["nodes"]["train"]["status"] == "cached"
