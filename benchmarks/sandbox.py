"""Sandbox overhead per test: the same program run in the bubblewrap jail vs a bare subprocess.

    .venv/bin/python benchmarks/sandbox.py [--n 30] [--runs 7]

For each program (Python a+b, compiled C++ a+b, /bin/true) it times N runs of
  bare:    subprocess.run(cmd, input=stdin, capture_output=True)   (no limits, no namespaces)
  sandbox: Jail.run(...) with the limits run_tests uses (fresh namespaces + rlimits + reaping)
interleaved, and prints median ms, the overhead (sandbox - bare) and the ratio sandbox / bare.
Also times whole run_tests calls (20 tests) for Python and C++ (compile included).

Function-call grading (reward.calls), per test, the same 20 tests of add(a, b) three ways, --runs times
interleaved (median): a bare in-process call compared with == (no sandbox: the floor), stdin/stdout
grading (run_tests: one sandboxed process per test), and function-call grading (run_call_tests: all
calls in one sandboxed process, results compared outside it). It prints each per-test time, the
overhead over the bare call, and the ratio function-call / stdin-stdout (the target: <= 1). Then the
cost of test code that must run (HumanEval/53's random check): first grade (expansion included) and
a cached one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_rl.reward.calls import run_call_tests
from megatron_rl.reward.code import CodeLimits, Toolchain, rlimits, run_tests
from megatron_rl.reward.sandbox import BOX, available

PY_ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
CPP_ADD = ("#include <iostream>\nint main(){ long long a, b; std::cin >> a >> b;"
           " std::cout << a + b << '\\n'; }\n")


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--runs", type=int, default=7, help="interleaved runs of the function-call comparison")
    args = ap.parse_args()
    tc = Toolchain()
    jail, cpp_jail = tc.jail("python"), tc.jail("cpp")
    ok, why = available(jail)
    if not ok:
        print(f"sandbox unavailable: {why}")
        return 1
    lim = CodeLimits()
    rl = rlimits(lim, lim.test_timeout_s, lim.memory_mb, lim.fsize_mb)
    stdin = b"123 456\n"
    with tempfile.TemporaryDirectory() as host_dir, jail.workspace() as ws:
        for d in (host_dir, ws):  # same program in both places: host path and /box
            with open(os.path.join(d, "main.py"), "w") as f:
                f.write(PY_ADD)
            with open(os.path.join(d, "main.cpp"), "w") as f:
                f.write(CPP_ADD)
            subprocess.run([tc.gxx, "-O2", "-o", os.path.join(d, "prog"),
                            os.path.join(d, "main.cpp")], check=True)
            os.chmod(os.path.join(d, "prog"), 0o755)
            os.chmod(os.path.join(d, "main.py"), 0o644)
        progs = {
            "python a+b": ([tc.python, "-I", f"{host_dir}/main.py"], [tc.python, "-I", f"{BOX}/main.py"]),
            "c++ a+b": ([f"{host_dir}/prog"], [f"{BOX}/prog"]),
            "/bin/true": (["/bin/true"], ["/bin/true"]),
        }
        print(f"{'program':12s} {'bare ms':>9s} {'sandbox ms':>11s} {'overhead ms':>12s} {'ratio':>7s}"
              f"   (median of {args.n}, interleaved)")
        for name, (bare_cmd, box_cmd) in progs.items():
            jl = jail if name.startswith("python") else cpp_jail
            bare, box = [], []
            for _ in range(args.n):
                t = time.perf_counter()
                r = subprocess.run(bare_cmd, input=stdin, capture_output=True)
                bare.append(time.perf_counter() - t)
                t = time.perf_counter()
                o = jl.run(box_cmd, stdin=stdin, rlimits=rl, wall_s=10, max_output=1 << 20,
                             workspace=ws)
                box.append(time.perf_counter() - t)
                assert r.stdout == o.stdout and o.exit_code == r.returncode, (r, o)
            b, s = median_ms(bare), median_ms(box)
            print(f"{name:12s} {b:9.1f} {s:11.1f} {s - b:12.1f} {s / b:7.2f}")
    tests = [{"input": f"{i} {i}\n", "output": f"{2 * i}\n"} for i in range(20)]
    for lang, code in (("python", PY_ADD), ("cpp", CPP_ADD)):
        t = time.perf_counter()
        r = run_tests(code, tests, lang)
        total = time.perf_counter() - t
        assert r.passed, r
        print(f"run_tests {lang:6s} 20 tests: {total * 1000:7.0f} ms total, compile "
              f"{r.compile_s * 1000:5.0f} ms, per test median {median_ms(r.test_s):6.1f} ms")
    function_calls(args.runs)
    return 0


PY_ADD_FN = "def add(a, b):\n    return a + b\n"


def bare_calls(pairs: list[tuple[int, int]]) -> float:
    """Seconds for the in-process floor: exec the solution, call it on every test, compare with ==."""
    t = time.perf_counter()
    ns: dict = {}
    exec(PY_ADD_FN, ns)
    assert all(ns["add"](a, b) == a + b for a, b in pairs)
    return time.perf_counter() - t


def function_calls(runs: int) -> None:
    pairs = [(i, 3 * i + 1) for i in range(20)]
    stdio = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in pairs]
    calls = [{"function": "add", "args": [a, b], "expected": a + b} for a, b in pairs]
    times: dict[str, list[float]] = {"bare in-process call": [], "stdin/stdout (run_tests)": [],
                                     "function calls (run_call_tests)": []}
    for _ in range(runs):
        times["bare in-process call"].append(bare_calls(pairs))
        t = time.perf_counter()
        assert run_tests(PY_ADD, stdio).passed
        times["stdin/stdout (run_tests)"].append(time.perf_counter() - t)
        t = time.perf_counter()
        assert run_call_tests(PY_ADD_FN, calls).passed
        times["function calls (run_call_tests)"].append(time.perf_counter() - t)
    per_test = {k: statistics.median(v) * 1000 / len(pairs) for k, v in times.items()}
    bare = per_test["bare in-process call"]
    print(f"\nper test, {len(pairs)} tests of add(a, b) per problem (median of {runs} runs, interleaved):")
    print(f"{'grading':32s} {'ms/test':>9s} {'overhead ms/test':>17s}")
    for name, ms in per_test.items():
        print(f"{name:32s} {ms:9.3f} {ms - bare:17.3f}")
    ratio = (per_test["function calls (run_call_tests)"] - bare) / (per_test["stdin/stdout (run_tests)"] - bare)
    print(f"overhead ratio function calls / stdin-stdout: {ratio:.3f} (target <= 1)")
    humaneval_expansion()


def humaneval_expansion() -> None:
    """Test code that must run (loops, random inputs): the first grade expands it in the sandbox."""
    from megatron_rl.data.humaneval import humaneval_problems
    from megatron_rl.reward.types import parse_task

    task = next(p.task for p in humaneval_problems() if p.problem_id == "HumanEval/53")
    suite = parse_task(task).calls
    code = task["meta"]["prompt"] + task["meta"]["canonical_solution"]
    for label in ("first (expansion + grading)", "cached expansion"):
        t = time.perf_counter()
        r = run_call_tests(code, suite, max_tests=1000)
        assert r.passed, r.message
        print(f"HumanEval/53, {r.n_tests} calls, {label}: {(time.perf_counter() - t) * 1000:7.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
