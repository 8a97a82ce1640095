"""pytest imports test files by basename (rootdir mode, no __init__.py), so two test files of one name
in different folders stop the whole suite at collection: every test file's name is unique."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], sorted(n for n, k in names.items() if k > 1)
