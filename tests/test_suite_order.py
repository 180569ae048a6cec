"""`make test` starts the longest test files first (tests/conftest.py LONGEST_FIRST): a renamed or removed file
would silently drop out of that order, and without --no-loadscope-reorder pytest-xdist orders files by their
number of tests instead (the long ones then started last, one worker running on while the others are done). The
numerics pass, which runs beside it, keeps its OpenMP threads from spinning and starts no Prefect server."""
from __future__ import annotations

import os
import re
from pathlib import Path

from conftest import LONGEST_FIRST

TESTS = Path(__file__).resolve().parent


def test_every_file_named_longest_first_exists_once():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [n for n in LONGEST_FIRST if not (TESTS / n).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that are not in tests/: {missing}"


def test_make_test_keeps_the_order():
    make = (TESTS.parent / "Makefile").read_text()
    avx2_pass = next(line for line in make.splitlines() if "--dist loadfile" in line)
    assert re.search(r"--no-loadscope-reorder\b", avx2_pass), avx2_pass


def _numerics_pass() -> str:
    """The Makefile's line that starts the numerics pass."""
    make = (TESTS.parent / "Makefile").read_text()
    return next(line for line in make.splitlines() if "-m numerics" in line)


def test_the_numerics_pass_beside_it_does_not_spin():
    # its OpenMP threads spinning while they wait took as much CPU as its work, beside the AVX2 pass (Makefile)
    numerics_pass = _numerics_pass()
    assert re.search(r"\bOMP_WAIT_POLICY=PASSIVE\b", numerics_pass), numerics_pass


def test_the_numerics_pass_starts_no_prefect_server_it_does_not_use(monkeypatch):
    # none of its tests uses a Prefect API: its controller makes no shared server or migrated database, and a
    # worker that needs one would start its own on first use (tests/conftest.py ON_DEMAND_ENV)
    from types import SimpleNamespace

    import conftest
    from prefect_server import MIGRATED_DB_ENV

    numerics_pass = _numerics_pass()
    assert re.search(rf"\b{conftest.ON_DEMAND_ENV}=1\b", numerics_pass), numerics_pass
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # as xdist's controller
    monkeypatch.delenv(conftest.SHARED_API_ENV, raising=False)
    monkeypatch.delenv(MIGRATED_DB_ENV, raising=False)
    monkeypatch.setenv(conftest.ON_DEMAND_ENV, "1")
    config = SimpleNamespace(option=SimpleNamespace(numprocesses=2))
    conftest.pytest_configure(config)
    assert conftest.SHARED_API_ENV not in os.environ and MIGRATED_DB_ENV not in os.environ
    assert not hasattr(config, "_loraflow_api_start") and not hasattr(config, "_loraflow_migrated")
