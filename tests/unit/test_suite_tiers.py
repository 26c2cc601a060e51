"""The suite's own bookkeeping (tests/support.py, tests/conftest.py): every file the fallback run names exists, and
every test file that switches the CPU fast paths (the cpu_fast_paths_on/off fixtures) is in the
fallback run."""

from __future__ import annotations

import re
from pathlib import Path

from support import FAST_PATH_FILES, TIERS

TESTS = Path(__file__).resolve().parents[1]


def test_the_fallback_files_exist():
    missing = sorted(name for name in FAST_PATH_FILES if not (TESTS / name).is_file())
    assert missing == [], f"FAST_PATH_FILES names files that are gone (renamed?): {missing}"


def test_files_that_touch_the_fast_paths_are_in_the_fallback_run():
    touches = re.compile(r"^def test_.*\bcpu_fast_paths_(on|off)\b|usefixtures\(\"cpu_fast_paths_(on|off)", re.M)
    unlisted = sorted(path.relative_to(TESTS).as_posix() for tier in TIERS for path in (TESTS / tier).glob("test_*.py")
                      if touches.search(path.read_text()) and path.relative_to(TESTS).as_posix() not in FAST_PATH_FILES)
    assert unlisted == [], f"add these to FAST_PATH_FILES in tests/support.py: {unlisted}"
