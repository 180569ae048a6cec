"""The VAE's precision and normalisation (issue 18, item 3): an fp16 model's SDXL/SD1.5 VAE encodes in fp32
where its config says force_upcast (the pipelines' rule), latents_mean/std are applied where the config
has them, both enter the latent's key, and a non-finite latent is reported, never cached."""
from __future__ import annotations

import json
import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tasks import cache_latents, validate  # noqa: E402
from tasks.config import ConfigError, compose, resolve_paths  # noqa: E402
from tasks.models.sdxl import SDXLAdapter  # noqa: E402
from tasks.models.tiny.tiny_unet import build_tiny_sdxl  # noqa: E402
from tasks.store import Store  # noqa: E402
from tolerance import assert_close
from support import a_plan


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl"))


def _edit_vae(src, dst, **changes):
    shutil.copytree(src, dst)
    path = dst / "vae" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return dst


def test_fp16_vae_is_upcast_where_the_config_says_so(tiny, tmp_path):
    adapter = SDXLAdapter(tiny, "float16")
    assert adapter.load_vae().dtype == torch.float32
    assert adapter.latent_settings() == {"vae_dtype": "float32"}
    plain = SDXLAdapter(_edit_vae(tiny, tmp_path / "m", force_upcast=False), "float16")
    assert plain.load_vae().dtype == torch.float16 and plain.latent_settings() == {}
    assert SDXLAdapter(tiny, "float32").latent_settings() == {}  # fp32 keys as before


@pytest.mark.numerics
def test_latents_mean_and_std_are_applied(tiny, tmp_path):
    mean, std = [0.1, -0.2, 0.3, 0.0], [2.0, 1.5, 0.5, 1.0]
    adapter = SDXLAdapter(_edit_vae(tiny, tmp_path / "m", latents_mean=mean, latents_std=std), "float32")
    assert adapter.latent_settings() == {"latents_stats": True}
    vae = adapter.load_vae()
    pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mode = vae.encode(pixels).latent_dist.mode()
    expected = (mode - torch.tensor(mean).view(1, 4, 1, 1)) * vae.config.scaling_factor / torch.tensor(std).view(1, 4, 1, 1)
    # the same VAE mode, then a shift and two scalings in another order: 3 roundings an element
    assert_close(adapter.encode_latents(vae, pixels), expected, n=1, stages=3, what="latents")


def test_vae_compute_dtype_is_in_the_latent_key(tmp_path):
    def params(dtype):
        cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}", "model=tiny_sdxl",
                                              f"model.dtype={dtype}"])[0])
        plan = a_plan(family="sdxl", model_dir=str(tiny_dir), ids={"vae": "v"})
        return cache_latents.params(cfg, plan)

    tiny_dir = build_tiny_sdxl(tmp_path / "m")
    assert params("float16")["vae_dtype"] == "float32"
    assert "vae_dtype" not in params("float32")


def test_non_finite_latents_are_reported_not_cached(tmp_path, monkeypatch):
    from tasks.models.flux import FluxAdapter

    cfg = resolve_paths(compose("train", [f"store.root={tmp_path / 'store'}"])[0])
    store = Store(tmp_path / "store")
    plan = validate.run(cfg, store)
    bad = plan.items[3]["name"]
    original, calls = FluxAdapter.encode_latents, []

    def nan_once(self, vae, pixels):
        z = original(self, vae, pixels)
        calls.append(1)
        return z * float("nan") if len(calls) == 4 else z

    monkeypatch.setattr(FluxAdapter, "encode_latents", nan_once)
    with pytest.raises(ConfigError, match=rf"non-finite latents .* {bad}.*model.dtype=float32"):
        cache_latents.run(cfg, plan, store)
    keys = cache_latents.item_keys(cfg, plan)
    assert not store.valid("latents", keys[bad])
    assert all(store.valid("latents", k) for n, k in keys.items() if n != bad)
