"""Math verification: megatron_rl.reward.math vs math-verify on the same labelled pairs.

Both run in the same kind of forked, time-limited worker (math.pool.WorkerPool, one worker each,
so checks/s is per core); math-verify also uses its own SIGALRM timeouts inside its worker.
Prints accuracy (overall and per category), checks/s per core (all items and without the hostile
ones), the ratio mine / math-verify, and every item on which the two disagree.

    .venv/bin/python benchmarks/math_verify.py [--data tests/data/math_equivalence.jsonl] [--timeout 5]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# this file is named like the baseline package: keep `import math_verify` from importing itself
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from megatron_rl.reward import math as rmath  # noqa: E402
from megatron_rl.reward.math.pool import WorkerPool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _math_verify_equal(prediction: str, reference: str, timeout: int) -> bool:
    from math_verify import parse, verify

    logging.disable(logging.CRITICAL)  # it logs every timeout with the whole (huge) input

    gold = parse("\\boxed{" + reference + "}", parsing_timeout=timeout)
    pred = parse("\\boxed{" + prediction + "}", parsing_timeout=timeout)
    return bool(verify(gold, pred, timeout_seconds=timeout))


def run_mine(rows, timeout: float):
    os.environ["MEGATRON_RL_MATH_WORKERS"] = "1"
    rmath.check("1", "2", timeout)  # fork + warm outside the timing
    out = []
    for r in rows:
        t = time.perf_counter()
        res = rmath.check(r["prediction"], r["reference"], timeout)
        out.append((res.equal, res.status, time.perf_counter() - t))
    return out


def run_math_verify(rows, timeout: float):
    import math_verify  # noqa: F401  (import before forking the worker)

    pool = WorkerPool(_math_verify_equal, max_workers=1)
    pool.call(("1", "2", int(timeout)), 60)  # warm
    out = []
    for r in rows:
        t = time.perf_counter()
        # math-verify's own limits are per parse / verify; the pool's limit bounds the whole call
        res = pool.call((r["prediction"], r["reference"], max(1, int(timeout))), 3 * timeout + 1)
        out.append((res.status == "ok" and bool(res.value), res.status, time.perf_counter() - t))
    pool.close()
    return out


def summarise(name, rows, results):
    correct = sum(res[0] == r["expected"] for r, res in zip(rows, results))
    total_t = sum(res[2] for res in results)
    normal = [(r, res) for r, res in zip(rows, results) if r["category"] != "hostile"]
    normal_t = sum(res[2] for _, res in normal)
    statuses = defaultdict(int)
    for res in results:
        statuses[res[1]] += 1
    print(f"{name:12s} accuracy {correct}/{len(rows)} = {correct / len(rows):.3f}   "
          f"checks/s/core all {len(rows) / total_t:7.1f}   non-hostile {len(normal) / normal_t:7.1f}   "
          f"worst {max(res[2] for res in results):.2f}s   statuses {dict(statuses)}")
    return correct, len(normal) / normal_t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "tests/data/math_equivalence.jsonl"))
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--limit", type=int, default=0, help="only the first N pairs (0: all)")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    if args.limit:
        rows = rows[: args.limit]
    mv = run_math_verify(rows, args.timeout)
    mine = run_mine(rows, args.timeout)
    print(f"{len(rows)} labelled pairs, timeout {args.timeout}s, one worker process each\n")
    c_mine, r_mine = summarise("megatron_rl", rows, mine)
    c_mv, r_mv = summarise("math-verify", rows, mv)
    print(f"\nratio megatron_rl / math-verify: accuracy {c_mine / c_mv:.3f}, "
          f"non-hostile checks/s per core {r_mine / r_mv:.2f}x")
    print("\nper category (megatron_rl / math-verify correct of n):")
    cats = defaultdict(lambda: [0, 0, 0])
    for r, a, b in zip(rows, mine, mv):
        c = cats[r["category"]]
        c[0] += a[0] == r["expected"]
        c[1] += b[0] == r["expected"]
        c[2] += 1
    for cat, (a, b, n) in sorted(cats.items()):
        print(f"  {cat:22s} {a:3d} / {b:3d} of {n}")
    print("\ndisagreements (expected | megatron_rl | math-verify):")
    for r, a, b in zip(rows, mine, mv):
        if a[0] != b[0]:
            who = "megatron_rl right" if a[0] == r["expected"] else "math-verify right"
            print(f"  [{r['category']}] {r['prediction'][:60]!r} vs {r['reference'][:60]!r}: "
                  f"{r['expected']} | {a[0]} ({a[1]}) | {b[0]} ({b[1]}) -> {who}")
    rmath.close_pool()
    return 0


if __name__ == "__main__":
    sys.exit(main())
