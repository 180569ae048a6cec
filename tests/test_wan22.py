"""Issue 33: Wan 2.2's two experts (`model=tiny_wan22`, tasks/models/wan22.py), at the node functions.

- `model.expert=high|low` trains that expert alone, on timesteps of its side of the pipeline's boundary
  (boundary_ratio x 1000, where WanPipeline switches experts), drawn deterministically.
- Its LoRA file loads where Wan 2.2 LoRAs load: diffusers' `load_lora_weights` into `transformer` (high) or with
  `load_into_transformer_2=True` (low); the other expert is left as it was.
- The two experts' runs share every cache (a sweep over model.expert computes the latents and texts once).
"""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks import cache_latents, cache_text, publish, train, validate
from tasks.config import ConfigError, compose, resolve_paths
from tasks.data.clips import write_mp4
from tasks.models import make_adapter
from tasks.store import Store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def root(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    frames = [np.roll(np.full((32, 32, 3), (200, 40, 40), np.uint8) * (np.arange(32) < 12)[None, :, None], 2 * k, 1)
              for k in range(9)]
    write_mp4(frames, data / "clip.mp4", 16)
    (data / "clip.txt").write_text("a red bar moving right\n")
    shutil.copyfile(REPO / "data" / "demo" / "img_01.png", data / "still.png")
    (data / "still.txt").write_text("a still picture\n")
    (tmp_path / "prompts.txt").write_text("a red bar moving right --f 5\n")
    return tmp_path


def _cfg(root, *extra):
    return resolve_paths(compose("train", [
        "model=tiny_wan22", f"data.dir={root / 'data'}", f"store.root={root / 'store'}", "data.resolution=32",
        "data.frames=9", f"sample.prompts_file={root / 'prompts.txt'}", "train.max_steps=2", "train.batch_size=2",
        "train.log_with=none", "sample.steps=2", *extra])[0])


@pytest.mark.parametrize("expert", ["high", "low"])
def test_expert_draws_keep_to_its_side_of_the_boundary(root, expert):
    cfg = _cfg(root, f"model.expert={expert}")
    plan = validate.run(cfg, Store(root / "store"))
    adapter = make_adapter(cfg.model, Path(plan.model_dir))
    assert adapter.boundary == 875.0 and adapter.denoiser_subfolder == {"high": "transformer", "low": "transformer_2"}[expert]
    scheduler = adapter.load_train_scheduler()
    latents = torch.zeros(64, 16, 3, 4, 4)
    tc = replace(cfg.train, weighting_scheme="none")
    draws = [adapter.draw(latents, tc, scheduler, [torch.Generator().manual_seed(i) for i in range(64)]) for _ in range(2)]
    t = draws[0][2]
    assert bool((t >= 875).all()) if expert == "high" else bool((t < 875).all())
    assert torch.equal(t, draws[1][2]) and torch.equal(draws[0][1], draws[1][1])  # seeded: the same draws
    sigmas = draws[0][3].flatten()
    assert torch.allclose(t, sigmas * 1000)  # noise level and timestep stay paired after a redraw


@pytest.mark.parametrize("expert", ["high", "low"])
def test_expert_lora_loads_into_its_transformer_only(root, expert):
    from diffusers import WanPipeline

    cfg, store = _cfg(root, f"model.expert={expert}", "export.format=both"), Store(root / "store")
    plan = validate.run(cfg, store)
    lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
    lora = train.run(cfg, plan, store, lat["items"], txt["items"])
    mine, other = ("transformer", "transformer_2") if expert == "high" else ("transformer_2", "transformer")
    for file in (publish.diffusers_file(store, lora), publish.kohya_file(cfg, plan, store, lora)):
        pipe = WanPipeline.from_pretrained(plan.model_dir, use_safetensors=True)
        before = {n: p.clone() for n, p in getattr(pipe, other).state_dict().items()}
        pipe.load_lora_weights(str(file), **({"load_into_transformer_2": True} if expert == "low" else {}))
        assert any("lora_A" in n for n in getattr(pipe, mine).state_dict())
        after = getattr(pipe, other).state_dict()
        assert not any("lora_A" in n for n in after) and all(torch.equal(before[n], after[n]) for n in before)
    # the sampler (samples during and after training) puts the LoRA where the file's expert is
    pipe = make_adapter(cfg.model, Path(plan.model_dir)).load_sampler(Path(lora["lora"]))
    assert any("lora_A" in n for n in getattr(pipe, mine).state_dict())
    assert not any("lora_A" in n for n in getattr(pipe, other).state_dict())


def test_the_two_experts_share_every_cache(root):
    store = Store(root / "store")
    keys = {}
    for expert in ("high", "low"):
        cfg = _cfg(root, f"model.expert={expert}")
        plan = validate.run(cfg, store)
        lat, txt = cache_latents.run(cfg, plan, store), cache_text.run(cfg, plan, store)
        keys[expert] = (lat["items"], txt["items"], train.key_of_node(cfg, plan, lat["items"], txt["items"]))
        if expert == "low":
            assert (lat["computed"], txt["computed"]) == (0, 0)
    assert keys["high"][:2] == keys["low"][:2] and keys["high"][2] != keys["low"][2]


def test_expert_errors_name_the_key(root):
    with pytest.raises(ConfigError, match="model.expert='middle'"):
        validate.run(_cfg(root, "model.expert=middle"), Store(root / "store"))
    cfg = resolve_paths(compose("train", ["model=tiny_wan", f"data.dir={root / 'data'}", f"store.root={root / 'store'}",
                                          "data.resolution=32", "data.frames=9", "model.expert=high",
                                          f"sample.prompts_file={root / 'prompts.txt'}"])[0])
    with pytest.raises(ConfigError, match="only Wan 2.2"):
        validate.run(cfg, Store(root / "store"))
