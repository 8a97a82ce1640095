"""`./dev`, the entry point of a fresh machine: `./dev bench` without a NAME lists the benchmarks
(it failed with `$1: unbound variable`), an unknown NAME is refused with that list."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NAMES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))


def _dev(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "dev"), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_bench_without_a_name_lists_the_benchmarks():
    p = _dev("bench")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.startswith("usage: ./dev bench NAME [ARGS]")
    listed = [line.split()[0] for line in p.stdout.splitlines()[1:]]
    assert listed == NAMES
    assert "  answer_scan  " in p.stdout and "Answer scanning on hostile responses" in p.stdout


def test_bench_with_an_unknown_name_says_so_and_lists_them():
    p = _dev("bench", "no_such_bench")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.startswith("no benchmark 'no_such_bench'\n") and "weight_sync" in p.stderr
