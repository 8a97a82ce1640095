"""Verifier pool throughput vs grading the same items sequentially in one process.

Items: well-formed math responses (half right, half wrong) and Python programs run in the sandbox.
Prints items/s of both, the ratio, and the pool's timing report (parallelism = grade time / wall).

    .venv/bin/python benchmarks/verifier_pool.py [--items 48] [--workers 2]
"""
from __future__ import annotations

import argparse
import time

from megatron_rl.config import RewardConfig
from megatron_rl.reward import VerifierPool, score

THOUGHTS = "We add the two numbers carefully, checking the carry in each column before writing the result."


def make_items(n: int) -> list[tuple[dict, str, int]]:
    items = []
    for i in range(n):
        a, b = 17 * i + 3, 29 * i + 5
        if i % 4 == 3:  # every fourth item is a program run against two tests in the sandbox
            task = {"kind": "code", "language": "python", "problem": "Print the sum of two integers.",
                    "tests": [{"input": f"{a} {b}\n", "output": f"{a + b}\n"}, {"input": "1 1\n", "output": "2\n"}]}
            resp = f"<think>{THOUGHTS}</think>\n```python\nx, y = map(int, input().split())\nprint(x + y)\n```"
        else:
            task = {"kind": "math", "answer": str(a + b), "problem": f"What is {a} + {b}?"}
            guess = a + b if i % 2 == 0 else f"\\frac{{{2 * (a + b) + 1}}}{{2}}"
            resp = f"<think>{THOUGHTS}</think>\nThe answer is $\\boxed{{{guess}}}$."
        items.append((task, resp, 200))
    return items


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    cfg = RewardConfig()
    items = make_items(args.items)
    score(*items[0][:2], cfg)  # warm caches (language model, math worker, sandbox jail) before timing
    t = time.perf_counter()
    seq = [score(task, resp, cfg, n) for task, resp, n in items]
    t_seq = time.perf_counter() - t
    with VerifierPool(cfg, workers=args.workers) as pool:
        pool.wait_ready()
        pool.map(items[:args.workers])  # warm the workers
        t = time.perf_counter()
        par = pool.map(items)
        t_par = time.perf_counter() - t
        stats = pool.last_stats
    assert [r.total for r in seq] == [r.total for r in par], "pool and sequential grading disagree"
    print(f"{len(items)} items ({sum(r.correct for r in seq)} correct), {args.workers} workers")
    print(f"sequential: {len(items) / t_seq:.1f} items/s; pool: {len(items) / t_par:.1f} items/s "
          f"(ratio {t_seq / t_par:.2f}x)")
    print(f"pool timings: wall {stats.wall_s:.2f} s, grading {stats.grade_s_total:.2f} s "
          f"(parallelism {stats.grade_s_total / stats.wall_s:.2f}), slowest item {stats.grade_s_max * 1e3:.0f} ms, "
          f"statuses {stats.by_status}")


if __name__ == "__main__":
    main()
