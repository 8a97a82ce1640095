"""The CPU demo's closing lines (examples/cpu_demo.sh, step 4): reward, pass rate and format rate of
the first and the last quarter of the updates that graded rollouts, then the held-out rounds.

Lines that graded nothing (the last update of a `run.updates=4` demo was one; rollout_stats logs
them as `rollouts: 0`) are left out of the windows: a window of them alone printed nan.

    python examples/cpu_demo_summary.py runs/cpu_demo/rl/metrics.jsonl
"""
from __future__ import annotations

import sys
from pathlib import Path

from megatron_rl.control.metrics import read_jsonl

KEYS = ("reward/mean", "pass_rate", "reward/format_ok")


def mean(rows: list[dict], key: str) -> float:
    """Weighted by the rollouts each line graded (every line here graded some)."""
    return sum(r.get(key, 0.0) * r["rollouts"] for r in rows) / sum(r["rollouts"] for r in rows)


def summary(rows: list[dict]) -> list[str]:
    graded = [r for r in rows if r.get("rollouts")]
    lines = []
    if graded:
        k = max(1, len(graded) // 4)
        head, tail = graded[:k], graded[-k:]
        lines += [f"{key:18s} first {k} updates {mean(head, key):.3f} -> last {k} updates {mean(tail, key):.3f}"
                  for key in KEYS]
    else:
        lines.append(f"no rollout graded in {len(rows)} metrics lines: nothing to summarise")
    for r in rows:  # the held-out evaluation rounds (run.eval_every)
        if "eval/pass@1" in r:
            lines.append(f"held-out after update {r['update']:3d}: pass@1 {r['eval/pass@1']:.3f}  "
                         f"pass@4 {r.get('eval/pass@4', float('nan')):.3f}  ({r['eval/problems']} problems, "
                         f"{r['eval/ungradable']} ungradable)")
    return lines


if __name__ == "__main__":
    print("\n".join(summary(read_jsonl(Path(sys.argv[1])))))
