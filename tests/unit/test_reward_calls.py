"""Function-call tests graded in the real sandbox (reward.calls): per-test statuses and partial results,
per-call time limits, load failures, expansion of test code that must run, and the same verdicts
through reward.score (training) and data.humaneval.grade (evaluate). Each test groups many calls into
one sandboxed process, as grading does."""
from __future__ import annotations

import json

import pytest

from megatron_rl.reward import score
from megatron_rl.reward.call_tests import parse_call_tests
from megatron_rl.reward.call_types import TestFormError
from megatron_rl.reward.calls import run_call_tests
from megatron_rl.reward.code import Toolchain
from megatron_rl.reward.sandbox import available

pytestmark = pytest.mark.skipif(not available(Toolchain().jail())[0],
                                reason=f"no sandbox: {available(Toolchain().jail())[1]}")

SOLUTION = '''
import math

def add(a, b=0):
    return a + b

def div(a, b):
    return a / b

def grow(n):
    return bytearray(n)

def thing(kind):
    return {"none": None, "obj": object(), "gen": (i for i in range(2)), "nan": math.nan, "tuple": (1, [2])}[kind]

def exits(code):
    raise SystemExit(code)

class Solution:
    def __init__(self):
        self.calls = 0

    def twice(self, x):
        self.calls += 1
        return [x, x] if self.calls == 1 else None   # a fresh instance per call: always [x, x]
'''

CASES = [  # (test, expected status); the in-process reference decides ok / not ok
    ({"function": "add", "args": [2, 3], "expected": 5}, "ok"),
    ({"function": "add", "args": [2], "kwargs": {"b": 4}, "expected": 6}, "ok"),
    ({"function": "add", "args": [0.1, 0.2], "expected": 0.3}, "ok"),
    ({"function": "add", "args": [2, 2], "expected": 5}, "wrong_answer"),
    ({"function": "div", "args": [1, 0], "expected": 0}, "runtime_error"),
    ({"function": "grow", "args": [1 << 40], "expected": 0}, "memory"),
    ({"function": "thing", "args": ["none"], "expected": None}, "ok"),
    ({"function": "thing", "args": ["obj"], "expected": None}, "wrong_answer"),
    ({"function": "thing", "args": ["gen"], "expected": [0, 1]}, "wrong_answer"),
    ({"function": "thing", "args": ["nan"], "expected": float("nan")}, "ok"),
    ({"function": "thing", "args": ["tuple"], "expected": [1, (2,)]}, "ok"),
    ({"function": "exits", "args": [0], "expected": None}, "runtime_error"),
    ({"call": "Solution().twice('ab')", "expected": ["ab", "ab"]}, "ok"),
    ({"call": "Solution().twice(7)", "expected": [7, 7]}, "ok"),
    ({"function": "missing", "args": [], "expected": 1}, "runtime_error"),
    ("assert add(40, 2) == 42", "ok"),
    ("assert sorted(add([3], [1])) == [1, 3]", "ok"),
]


def test_every_test_gets_a_status_and_the_rest_run_after_a_failure():
    r = run_call_tests(SOLUTION, [t for t, _ in CASES], memory_mb=512)
    assert r.test_statuses == [s for _, s in CASES], r.message
    assert (r.n_passed, r.n_tests, r.passed) == ([s for _, s in CASES].count("ok"), len(CASES), False)
    assert (r.first_failed, r.status) == (3, "wrong_answer") and "eq 5: got 4" in r.message
    assert len(r.test_s) == len(CASES) and r.sandboxed
    ok = run_call_tests(SOLUTION, [t for t, s in CASES if s == "ok"])
    assert (ok.passed, ok.status, ok.n_passed) == (True, "ok", ok.n_tests)


def test_each_call_has_its_own_time_limit_kept_outside_the_sandbox():
    code = ("import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"  # no in-process alarm to rely on
            "def nap(s):\n    time.sleep(s)\n    return s\n")
    calls = [{"function": "nap", "args": [s], "expected": s} for s in (0.5, 0.5, 0.5, 30, 0.0)]
    r = run_call_tests(code, calls, test_timeout_s=1.5)
    # three naps of 0.5 s take longer than one limit together: the limit is per call, not per process
    assert r.test_statuses == ["ok", "ok", "ok", "timeout", "not_run"], r.message
    assert r.total_s < 10


def test_load_failures_fail_every_test():
    calls = [{"function": "f", "args": [], "expected": 1}] * 3
    for code, status, word in [("def f(:\n    pass\n", "compile_error", "SyntaxError"),
                               ("raise ValueError('at import')\ndef f():\n    return 1\n", "runtime_error", "ValueError"),
                               ("import sys\nsys.exit(0)\ndef f():\n    return 1\n", "runtime_error", "SystemExit"),
                               ("import os\nos._exit(0)\n", "runtime_error", "ended")]:
        r = run_call_tests(code, calls)
        assert (r.status, r.n_passed, r.test_statuses) == (status, 0, [status] * 3) and word in r.message, r


def test_output_flood_stops_the_run_at_the_call_in_flight():
    code = "def f(n):\n    if n == 2:\n        while True:\n            print('x' * 4096)\n    return n\n"
    r = run_call_tests(code, [{"function": "f", "args": [n], "expected": n} for n in range(4)], max_output_bytes=1 << 16)
    assert r.test_statuses == ["ok", "ok", "output_limit", "not_run"], r.message


def test_expansion_runs_the_test_code_jailed_seeded_and_without_the_candidate():
    test_code = ("import random, os\n\ndef check(candidate):\n    assert candidate(0) == 0\n"
                 "    for _ in range(30):\n        x = random.randint(0, 10**9)\n        assert candidate(x) == 2 * x\n"
                 "    assert not os.path.exists('/box/solution.py')\n")  # the candidate's code is not there
    suite = parse_call_tests(test_code, "double")
    r = run_call_tests("def double(x):\n    return 2 * x\n", suite, max_tests=100)
    assert (r.passed, r.n_tests) == (True, 31), r.message
    assert run_call_tests("def double(x):\n    return 2 * x\n", suite).n_tests == 20  # max_tests caps the calls
    r2 = run_call_tests("def double(x):\n    return x + x if x % 7 else 1\n", suite, max_tests=100)
    assert 0 < r2.n_passed < 31  # partial: the multiples of 7 fail
    # the same random inputs in a fresh process (the cache of this one is cleared)
    from megatron_rl.reward import expand

    expand._CACHE.clear()
    again = run_call_tests("def double(x):\n    return x + x if x % 7 else 1\n", suite, max_tests=100)
    assert again.test_statuses == r2.test_statuses
    with pytest.raises(TestFormError, match="no call of the function"):  # else anything would pass
        run_call_tests("def f(x):\n    return x\n", "def check(candidate):\n    for x in []:\n"
                       "        assert candidate(x) == x\n", "f")
    with pytest.raises(TestFormError, match=r"raised ZeroDivisionError: .* at `.*1 / 0"):
        run_call_tests("def f(x):\n    return x\n", "def check(candidate):\n    y = 1 / 0\n"
                       "    assert candidate(1) == y\n", "f")


def test_training_and_evaluate_grade_humaneval_alike(tmp_path):
    """HumanEval problems written to a JSONL file (prompt, tests, entry_point columns) and graded by the
    reward, against data.humaneval.grade: the same verdict and the same status."""
    from megatron_rl.data import read_problems
    from megatron_rl.data.humaneval import grade, humaneval_problems

    chosen = {p.problem_id: p for p in humaneval_problems() if p.problem_id in
              ("HumanEval/0", "HumanEval/38", "HumanEval/44", "HumanEval/53", "HumanEval/33", "HumanEval/32")}
    rows = [{"id": pid, "prompt": p.prompt, "tests": p.task["tests"], "entry_point": p.task["entry_point"]}
            for pid, p in chosen.items() if pid != "HumanEval/32"]
    path = tmp_path / "he.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for problem in read_problems(path):
        he = chosen[problem.problem_id].task
        right = he["meta"]["prompt"] + he["meta"]["canonical_solution"]
        wrong = he["meta"]["prompt"] + "    return None\n"
        for code, correct in ((right, True), (wrong, False)):
            response = f"<think>I will write it.</think>\n```python\n{code}```"
            ours, theirs = score(problem.task, response), grade(he, response)
            assert ours.correct == theirs.passed == correct, problem.problem_id
            assert ours.details["code_status"] == theirs.status
    # HumanEval/32 checks a property of the result: refused, and evaluate counts it as ungradable
    he32 = chosen["HumanEval/32"].task
    result = grade(he32, f"```python\n{he32['meta']['prompt'] + he32['meta']['canonical_solution']}```")
    assert (result.passed, result.status, result.gradable) == (False, "test_error", False)


def test_missing_sandbox_is_no_verdict(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap anywhere
    calls = [{"function": "f", "args": [], "expected": 1}]
    r = run_call_tests("def f():\n    return 1\n", calls)
    assert (r.passed, r.status, r.graded) == (False, "sandbox_unavailable", False) and "bwrap" in r.message
    r = run_call_tests("def f():\n    return 1\n", calls, allow_unsandboxed=True)
    assert (r.passed, r.sandboxed) == (True, False), r.message


def test_a_program_graded_on_a_task_of_either_kind_under_the_config_limits():
    """What a tool environment calls with a program: the reward's grading without the format gate."""
    from megatron_rl.config import RewardConfig
    from megatron_rl.reward.code_task import run_task_tests
    from megatron_rl.reward.types import TaskError

    code = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
    tasks = {"calls": {"kind": "code", "tests": [{"function": "add", "args": [i, i], "expected": 2 * i} for i in range(5)]},
             "stdio": {"kind": "code", "tests": [{"input": f"{i} {i}\n", "output": f"{2 * i}\n"} for i in range(5)]}}
    for kind, task in tasks.items():
        full = run_task_tests(task, code)
        capped = run_task_tests(task, code, RewardConfig(code_max_tests=2))
        assert (full.passed, full.n_tests, capped.passed, capped.n_tests) == (True, 5, True, 2), kind
    with pytest.raises(TaskError, match="a code task is needed"):
        run_task_tests({"kind": "math", "answer": "1"}, code)


def test_the_solution_is_read_as_python_reads_a_file():
    """A leading BOM loads as it does for `python main.py` (stdin/stdout tests), and a lone surrogate (no
    UTF-8 form) is a compile error for every test, not an exception of the verifier."""
    from megatron_rl.reward.code import run_tests

    calls = [{"function": "f", "args": [2], "expected": 4}, {"function": "f", "args": [3], "expected": 6}]
    bom = "\ufeffdef f(x):\n    return 2 * x\n\nif __name__ == '__main__':\n    print(f(int(input())))\n"
    r = run_call_tests(bom, calls)
    assert (r.passed, r.test_statuses) == (True, ["ok", "ok"]), r.message
    assert run_tests(bom, [{"input": "2\n", "output": "4\n"}]).passed  # the same program, as a script
    r = run_call_tests("def f(x):\n    return '\ud800' and 2 * x\n", calls)
    assert (r.status, r.test_statuses) == ("compile_error", ["compile_error"] * 2), r.message


def test_a_slow_program_is_graded_within_the_budget_of_the_config():
    """Every call just under its limit: 10 x 0.8 s outlast a pool item deadline of 4 s, after which the item
    would have no verdict (its group dropped, the wrong answers never scored 0). Under the config's limits
    the run ends at 3/4 of it, the call in flight "timeout" and the rest "not_run": a verdict."""
    from megatron_rl.config import RewardConfig
    from megatron_rl.reward.code_task import run_task_tests

    slow_wrong = "import time\ndef f(x):\n    time.sleep(0.8)\n    return -1\n"
    task = {"kind": "code", "tests": [{"function": "f", "args": [i], "expected": i} for i in range(10)]}
    r = run_task_tests(task, slow_wrong, RewardConfig(verifier_item_timeout_s=4.0, code_test_timeout_s=1.0))
    assert r.graded and not r.passed and r.total_s < 3.8, (r.total_s, r.test_statuses)
    k = r.test_statuses.index("timeout")
    assert 1 <= k <= 3 and r.test_statuses == ["wrong_answer"] * k + ["timeout"] + ["not_run"] * (9 - k)
