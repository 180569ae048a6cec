"""Every model preset in conf/model composes and passes the checks the CLI makes before any work: a real preset
the config checks refuse (HunyuanVideo 1.5's 1000 text tokens were, against a 512 cap meant for T5) is a command
no user can run."""
from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import compose
from tasks.config_checks import config_errors
from tasks.models import adapter_class

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_model_preset_passes_the_config_checks(preset, cuda):  # on a machine taken to have CUDA (sd15's fp16)
    family = compose("train", [f"model={preset}"])[0].model.family
    # an edit family needs its control images: the one setting a preset cannot carry
    extra = ["data.control_dirs=[/path/to/controls]"] if adapter_class(family).controls.required \
        and adapter_class(family).clips is None else []
    cfg = compose("train", [f"model={preset}", *extra])[0]
    assert config_errors(cfg) == [], f"model={preset}"


def test_the_image_to_video_families_have_real_presets():
    families = {compose("train", [f"model={p}"])[0].model.family: p for p in PRESETS if not p.startswith("tiny_")}
    assert {"wan_i2v", "wan22_i2v", "wan22_ti2v", "hunyuan_video15_i2v"} <= set(families)
