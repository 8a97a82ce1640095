"""The CPU demo's closing lines (examples/cpu_demo.sh, step 4): reward, pass rate and format rate of
the first and the last quarter of the updates that graded rollouts, then the held-out rounds and the
difference of held-out pass@1 between the first round (update 0: the initial weights) and the last,
with its 95% interval paired by problem (megatron_rl.evaluation.paired: normal approximation).

Lines that graded nothing (the last update of a `run.updates=4` demo was one; rollout_stats logs
them as `rollouts: 0`) are left out of the windows: a window of them alone printed nan.

    python examples/cpu_demo_summary.py runs/cpu_demo/rl/metrics.jsonl
"""
from __future__ import annotations

import sys
from pathlib import Path

from megatron_rl.control.metrics import read_jsonl
from megatron_rl.evaluation.paired import paired_difference

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
    rounds = [r for r in rows if "eval/pass@1" in r]  # the held-out evaluation rounds (run.eval_every)
    for r in rounds:
        pass_k = "".join(f"  {k[len('eval/'):]} {v:.3f}" for k, v in r.items()
                         if k.startswith("eval/pass@") and k != "eval/pass@1")  # k = run.eval_samples
        lines.append(f"held-out after update {r['update']:3d}: pass@1 {r['eval/pass@1']:.3f}{pass_k}  "
                     f"({r['eval/problems']} problems, {r['eval/ungradable']} ungradable)")
    if len(rounds) > 1 and all("eval/correct_by_problem" in r for r in (rounds[0], rounds[-1])):
        lines.append(difference_line(rounds[0], rounds[-1]))
    return lines


def difference_line(first: dict, last: dict) -> str:
    d = paired_difference(first["eval/correct_by_problem"], first["eval/graded_by_problem"],
                          last["eval/correct_by_problem"], last["eval/graded_by_problem"])
    return (f"held-out pass@1 update {first['update']} {d.before:.3f} -> update {last['update']} {d.after:.3f}: "
            f"difference {d.difference:+.3f}, {d.level:.0%} interval [{d.low:+.3f}, {d.high:+.3f}] "
            f"(paired by problem, normal approximation, {d.problems} problems)")


if __name__ == "__main__":
    print("\n".join(summary(read_jsonl(Path(sys.argv[1])))))
