"""`make test` starts the longest test files first (tests/conftest.py LONGEST_FIRST): a renamed or removed file
would silently drop out of that order, and without --no-loadscope-reorder pytest-xdist orders files by their
number of tests instead (the long ones then started last, one worker running on while the others are done). The
numerics pass, which runs beside it, keeps its OpenMP threads from spinning."""
from __future__ import annotations

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


def test_the_numerics_pass_beside_it_does_not_spin():
    # its OpenMP threads spinning while they wait took as much CPU as its work, beside the AVX2 pass (Makefile)
    make = (TESTS.parent / "Makefile").read_text()
    numerics_pass = next(line for line in make.splitlines() if "-m numerics" in line)
    assert re.search(r"\bOMP_WAIT_POLICY=PASSIVE\b", numerics_pass), numerics_pass
