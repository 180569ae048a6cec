"""Issue 44 item 1: what shared code knows of a family is declared by the family. Every family of the one
registry (tasks/models/__init__.py FAMILIES) declares its kohya names; export's family list is the registry's."""
from __future__ import annotations

import re

import pytest

from tasks.models import FAMILIES, adapter_class
from tasks.models.bases.adapter import Clips, Controls, KohyaLayout
from tasks.training import export


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_declares_its_kohya_names(family):
    kohya = adapter_class(family).kohya
    assert isinstance(kohya, KohyaLayout)
    assert kohya.network_module.startswith("networks.") and kohya.base_version
    assert kohya.names in ("rules", "named", "unet")
    if kohya.names == "rules":  # every rule a valid regex with a kohya name and a group size
        assert kohya.rules and all(re.compile(p) and name and size >= 1 for p, name, size in kohya.rules)
    else:
        assert not kohya.rules


def test_the_export_and_loraflow_lora_read_the_registry():
    assert export.FAMILIES == tuple(FAMILIES)
    versions = [adapter_class(f).kohya.base_version for f in FAMILIES]
    # a file's ss_base_model_version names its family, except where one transformer is another's (Kontext = FLUX.1)
    assert len(set(versions)) == len(versions) - 1 and versions.count("flux1") == 2


def test_each_original_layout_is_one_the_writer_knows():
    """loraflow-lora merge --into-base --layout original: the families that declare a layout, and only those."""
    from tasks.lora_tools.models import ORIGINAL_FAMILIES

    layouts = {f: adapter_class(f).original_layout for f in FAMILIES}
    assert set(layouts.values()) <= {None, "ldm", "flux", "flux2", "sd3", "zimage", "diffusers"}
    assert ORIGINAL_FAMILIES == tuple(f for f, v in layouts.items() if v)
    assert layouts["wan"] is None  # no released single-file writer: refused in one line (check_layout)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_declares_its_inputs(family):
    """Clips and control images are declarations the shared code reads (validate, the caching nodes), not flags:
    a video family declares its frame step and rate, an edit family its control images."""
    cls = adapter_class(family)
    assert isinstance(cls.controls, Controls) and cls.controls.most >= 0
    assert cls.controls.most or not (cls.controls.required or cls.controls.seen_by_text or cls.controls.min_side)
    assert cls.clips is None or (isinstance(cls.clips, Clips) and cls.clips.frame_step >= 1 and cls.clips.default_fps > 0)
    assert cls.swap_blocks or family in ("sd15", "sdxl")  # the UNets have no block lists to swap
    assert not any(hasattr(cls, old) for old in ("video", "frame_step", "default_fps", "max_controls",
                                                  "min_control_side", "requires_controls", "text_sees_controls"))


def test_the_registry_names_each_familys_tiny_builder_in_the_tiny_package():
    for family, (adapter, builder) in FAMILIES.items():
        assert adapter.split(":")[0] == f"tasks.models.{family}"  # one adapter per family: tasks/models/<family>.py
        assert builder.startswith("tasks.models.tiny.") and builder.endswith(f":build_tiny_{family}") or \
            family == "flux2_klein" and builder.endswith(":build_tiny_flux2")
