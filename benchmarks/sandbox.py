"""Sandbox overhead per test: the same program run in the bubblewrap jail vs a bare subprocess.

    .venv/bin/python benchmarks/sandbox.py [--n 30]

For each program (Python a+b, compiled C++ a+b, /bin/true) it times N runs of
  bare:    subprocess.run(cmd, input=stdin, capture_output=True)   (no limits, no namespaces)
  sandbox: Jail.run(...) with the limits run_tests uses (fresh namespaces + rlimits + reaping)
interleaved, and prints median ms, the overhead (sandbox - bare) and the ratio sandbox / bare.
Also times whole run_tests calls (20 tests) for Python and C++ (compile included).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
