"""Config composition: typed schema, errors that name the key, deployment-style compose."""
from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from tasks.config import compose, resolve_paths
from tasks.data.sizes import area_size, resolve_size
from tasks.validate import check_config
from tasks.config import ConfigError


def test_defaults_compose_with_demo_paths():
    cfg, run_dir = compose("train", ["hydra.run.dir=/tmp/somewhere"])
    plain = resolve_paths(cfg)
    assert plain.data.dir.endswith("data/demo")
    assert plain.model.family == "flux" and plain.model.name == "tiny_flux"
    assert str(run_dir) == "/tmp/somewhere"


def _error_text(overrides):
    with pytest.raises(ConfigError) as e:  # deployments get loraflow's error type, not Hydra's
        compose("train", overrides)
    assert isinstance(e.value.__cause__, ConfigCompositionException)
    return str(e.value)


def test_misspelt_key_fails_naming_it():
    """Refused before Hydra composes (which would suggest `+train.lrr=`), with or without `+`."""
    for override in ("train.lrr=1e-4", "+train.lrr=1e-4"):
        with pytest.raises(ConfigError, match=r"train\.lrr is not a loraflow setting; did you mean train\.lr\?"):
            compose("train", [override])
    compose("train", ["+model.arch.num_layers=1"])  # the tiny builder's free-form settings take new keys


def test_wrong_type_fails_naming_the_key():
    assert "train.lr" in _error_text(["train.lr=fast"])
    assert "train.max_steps" in _error_text(["train.max_steps=1.5"])


def test_bad_values_are_listed_with_their_keys():
    cfg, _ = compose("train", ["train.lr=-1", "data.resolution_type=bogus", "data.missing_caption=skip"])
    errors = "\n".join(check_config(resolve_paths(cfg)))
    for key in ("train.lr", "data.resolution_type", "data.missing_caption"):
        assert key in errors


def test_resolution_as_pixels_or_area():
    assert resolve_size(64, "pixels", 16) == (64, 64)
    assert resolve_size(1.0, "area", 16) == (1024, 1024)
    assert resolve_size(0.25, "area", 16) == (512, 512)
    assert area_size(1.0, 3 / 2, 16) == (1248, 832)  # 1.0 MP at 3:2, both sides multiples of 16
    assert area_size(1.0, 2 / 3, 16) == (832, 1248)
    assert area_size(1.0, 16 / 9, 8) == (1368, 768)
    assert resolve_size(1.0, "area", 8, aspect=3 / 2) == (1256, 840)  # SDXL/SD1.5 snap to 8
    with pytest.raises(ConfigError, match="data.resolution=70.*64.*80"):
        resolve_size(70, "pixels", 16)


@pytest.mark.parametrize("name,family", [("flux_dev", "flux"), ("sd3_medium", "sd3"), ("sdxl_base", "sdxl"),
                                         ("sd15", "sd15"), ("tiny_sd3", "sd3"), ("tiny_sdxl", "sdxl"),
                                         ("tiny_sd15", "sd15"), ("zimage_turbo", "zimage"),
                                         ("tiny_zimage", "zimage"), ("qwenimage", "qwenimage"),
                                         ("tiny_qwenimage", "qwenimage"), ("flux2_klein_base_9b", "flux2_klein"),
                                         ("tiny_flux2_klein", "flux2_klein"), ("tiny_flux2", "flux2_klein"),
                                         ("flux2_dev", "flux2_dev"), ("tiny_flux2_dev", "flux2_dev")])
def test_model_configs_compose(name, family, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # sd15 / sdxl_base: fp16 weights, GPU configs
    cfg, _ = compose("train", [f"model={name}", "model.config=/somewhere/base"])
    plain = resolve_paths(cfg)
    assert plain.model.family == family and plain.model.name == name
    assert (plain.model.path is None) == name.startswith("tiny_")
    assert check_config(plain) == []
