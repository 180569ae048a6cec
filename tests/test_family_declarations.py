"""Issue 44 item 1: what shared code knows of a family is declared by the family. Every family of the one
registry (tasks/models/__init__.py FAMILIES) declares its kohya names; export's family list is the registry's."""
from __future__ import annotations

import re

import pytest

from tasks.models import FAMILIES, adapter_class
from tasks.models.base import KohyaLayout
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
