"""A sandbox that cannot run is a grading failure, never a wrong answer: the real sandbox, a missing
bwrap, bwrap wrappers that fail the way a refusing host does, through run_tests, score and the pool.

The sandbox finds bwrap on PATH; spawned verifier workers inherit PATH, so each case is a real run."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from megatron_rl.config import RewardConfig
from megatron_rl.reward import VerifierPool, score
from megatron_rl.reward import sandbox as sandbox_mod
from megatron_rl.reward.code import Toolchain, run_tests, sandbox_probe
from megatron_rl.reward.sandbox import available

os.environ.setdefault("OMP_NUM_THREADS", "1")
pytestmark = pytest.mark.skipif(not available(Toolchain().jail())[0],
                                reason=f"no sandbox: {available(Toolchain().jail())[1]}")

CFG = RewardConfig(language_check=False, code_test_timeout_s=4.0)
TASK = {"kind": "code", "language": "python", "problem": "Print the sum of two integers.",
        "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}]}
GOOD = "a, b = map(int, input().split())\nprint(a + b)"
WRONG = "a, b = map(int, input().split())\nprint(a - b)"
# bwrap 0.8's own words when the kernel refuses an unprivileged user namespace (clone() -> EPERM)
REFUSED = ("bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
           "non-privileged user namespaces. On e.g. debian this can be enabled with "
           "'sysctl kernel.unprivileged_userns_clone=1'.")
REAL_BWRAP = shutil.which("bwrap")


def response(code: str) -> str:
    return f"<think>Read both integers and print their sum.</think>\n```python\n{code}\n```\n"


@pytest.fixture
def bin_dir():
    """A PATH directory the sandbox's unprivileged uid can reach (pytest's tmp_path is 0700 under root)."""
    path = tempfile.mkdtemp(prefix="mrl-fakebwrap-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def install_bwrap(bin_dir: str, body: str) -> None:
    script = os.path.join(bin_dir, "bwrap")
    with open(script, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(script, 0o755)


def test_real_sandbox_grades_right_and_wrong_programs():
    right, wrong = score(TASK, response(GOOD), CFG, 50), score(TASK, response(WRONG), CFG, 50)
    assert (right.status, right.grading_failed, right.correct) == ("ok", False, True)
    assert right.total == pytest.approx(CFG.format_reward + CFG.correct_reward)
    # a wrong program is a verdict (graded), not a failure
    assert (wrong.status, wrong.grading_failed, wrong.correct, wrong.details["code_status"]) == \
           ("ok", False, False, "wrong_answer")
    assert wrong.total == pytest.approx(CFG.format_reward)


@pytest.mark.parametrize("case", ["missing", "namespaces_refused", "setup_fails"])
def test_unusable_sandbox_is_a_grading_failure(monkeypatch, bin_dir, case):
    if case == "namespaces_refused":  # exits like bwrap on a host without user namespaces
        install_bwrap(bin_dir, f"echo \"{REFUSED}\" >&2\nexit 1")
    elif case == "setup_fails":  # the real bwrap, failing to build the sandbox (a bind source is missing)
        install_bwrap(bin_dir, f'exec {REAL_BWRAP} --ro-bind /nonexistent-mrl-src /mnt "$@"')
    monkeypatch.setenv("PATH", bin_dir)  # "missing": no bwrap at all
    r = run_tests(GOOD, TASK["tests"])
    assert (r.status, r.graded, r.passed, r.n_passed) == ("sandbox_unavailable", False, False, 0)
    b = score(TASK, response(GOOD), CFG, 50)
    assert (b.status, b.grading_failed, b.correct, b.total) == ("sandbox_unavailable", True, False, 0.0)
    assert b.format_ok and b.details["code_status"] == "sandbox_unavailable"
    want = {"missing": "not installed", "namespaces_refused": "No permissions to creating new namespace",
            "setup_fails": "Can't find source path /nonexistent-mrl-src"}[case]
    assert want in b.error, b.error
    ok, why = sandbox_probe()
    assert not ok and want in why and "\n" not in why
    # a format failure is still graded (it needs no sandbox): reward 0 as a verdict
    f = score(TASK, "no think block", CFG, 5)
    assert (f.status, f.grading_failed, f.format_ok) == ("ok", False, False)


def test_missing_compiler_is_a_grading_failure():
    r = run_tests("int main(){}", TASK["tests"], "cpp", toolchain=Toolchain(gxx=None))
    assert (r.status, r.graded, r.message) == ("sandbox_unavailable", False, "g++ not found")


def test_a_refusal_is_probed_again_later(monkeypatch, bin_dir):
    """A transient refusal must not disable grading in a long-lived worker for good."""
    marker = os.path.join(bin_dir, "healed")
    install_bwrap(bin_dir, f'[ -e {marker} ] && exec {REAL_BWRAP} "$@"\necho "{REFUSED}" >&2\nexit 1')
    monkeypatch.setenv("PATH", bin_dir)
    assert run_tests(GOOD, TASK["tests"]).status == "sandbox_unavailable"
    open(marker, "w").close()
    assert run_tests(GOOD, TASK["tests"]).status == "sandbox_unavailable"  # refusal still cached
    monkeypatch.setattr(sandbox_mod, "RETRY_REFUSED_S", 0.0)
    r = run_tests(GOOD, TASK["tests"])
    assert (r.status, r.passed, r.n_passed) == ("ok", True, 2)


def test_pool_workers_report_sandbox_unavailable(monkeypatch, bin_dir):
    install_bwrap(bin_dir, f"echo \"{REFUSED}\" >&2\nexit 1")
    monkeypatch.setenv("PATH", bin_dir)  # inherited by the spawned workers
    math_task = {"kind": "math", "answer": "4", "problem": "What is 2 + 2?"}
    items = [(TASK, response(GOOD), 50), (math_task, "<think>2 + 2 = 4</think>\n$\\boxed{4}$", 20),
             (TASK, response(WRONG), 50)]
    with VerifierPool(CFG, workers=2, item_timeout_s=60) as pool:
        got = pool.map(items)
        stats = pool.last_stats
    assert [(r.status, r.grading_failed) for r in got] == \
           [("sandbox_unavailable", True), ("ok", False), ("sandbox_unavailable", True)]
    assert got[1].correct and got[1].total == pytest.approx(CFG.format_reward + CFG.correct_reward)
    assert (stats.n_failed, stats.by_status) == (2, {"sandbox_unavailable": 2, "ok": 1})
