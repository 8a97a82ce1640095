"""The CPU demo's closing summary (examples/cpu_demo_summary.py, run as cpu_demo.sh runs it): a last
update that graded nothing (`run.updates=4`) printed `last 1 updates nan`; the held-out difference from
update 0 to the last round, with its paired interval."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _summary(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = subprocess.run([sys.executable, "examples/cpu_demo_summary.py", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _row(update: int, rollouts: int, reward: float) -> dict:
    if not rollouts:  # what control/metrics.rollout_stats logs for a window that graded nothing
        return {"update": update, "rollouts": 0.0}
    return {"update": update, "rollouts": float(rollouts), "reward/mean": reward, "pass_rate": reward / 2,
            "reward/format_ok": 1.0}


def test_windows_skip_updates_that_graded_nothing(tmp_path):
    rows = [_row(1, 8, 0.2), _row(2, 8, 0.4), _row(3, 4, 0.6), _row(4, 0, 0.0),
            {"update": 4, "eval/pass@1": 0.5, "eval/pass@4": 0.75, "eval/problems": 32, "eval/ungradable": 0}]
    out = _summary(tmp_path, rows)
    assert "nan" not in out, out
    assert "reward/mean        first 1 updates 0.200 -> last 1 updates 0.600" in out
    assert "pass_rate          first 1 updates 0.100 -> last 1 updates 0.300" in out
    assert "held-out after update   4: pass@1 0.500  pass@4 0.750  (32 problems, 0 ungradable)" in out


def test_quarters_are_weighted_by_rollouts_and_a_run_that_graded_nothing_says_so(tmp_path):
    rows = [_row(u, n, r) for u, n, r in [(1, 2, 0.0), (2, 6, 1.0), (3, 8, 0.5), (4, 8, 0.5),
                                          (5, 8, 0.5), (6, 8, 0.5), (7, 4, 0.0), (8, 4, 1.0)]]
    assert "reward/mean        first 2 updates 0.750 -> last 2 updates 0.500" in _summary(tmp_path, rows)
    assert "no rollout graded in 2 metrics lines" in _summary(tmp_path, [_row(1, 0, 0), _row(2, 0, 0)])


def test_held_out_difference_from_update_0_with_its_paired_interval(tmp_path):
    def round_row(update, correct):
        return {"update": update, "eval/pass@1": sum(correct) / 16, "eval/pass@4": 0.5, "eval/problems": 4,
                "eval/ungradable": 0, "eval/correct_by_problem": correct, "eval/graded_by_problem": [4] * 4}

    rows = [round_row(0, [4, 2, 0, 1]), _row(1, 8, 0.2), round_row(10, [0, 0, 0, 0]), _row(2, 8, 0.4),
            round_row(20, [4, 4, 2, 1])]
    out = _summary(tmp_path, rows)
    assert "held-out after update   0: pass@1 0.438" in out
    # the worked example of tests/unit/test_evaluation_paired.py: +0.25 +- 0.283
    assert ("held-out pass@1 update 0 0.438 -> update 20 0.688: difference +0.250, 95% interval "
            "[-0.033, +0.533] (paired by problem, normal approximation, 4 problems)") in out
