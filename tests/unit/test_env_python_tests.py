"""The python_tests environment: `run_tests` grades a program on the task's own tests in the real sandbox,
with the verdict reward.score gives the same program, and shows counts and statuses only (never a test's
input, expected value or the program's output); the python tool still works beside it; a run gets its
reward config (code limits) through `reward_config`."""
from __future__ import annotations

import json

import pytest

from megatron_rl.config import ConfigError, RewardConfig, config_from_dict
from megatron_rl.control.episodes import environment_args
from megatron_rl.env import PythonTests, StepResult, ToolSlots, make_environment
from megatron_rl.env.python_tests import verdict
from megatron_rl.reward import score
from megatron_rl.reward.code import CodeResult, Toolchain
from megatron_rl.reward.code_task import run_task_tests
from megatron_rl.reward.sandbox import available

SANDBOX = available(Toolchain().jail("python"))
needs_sandbox = pytest.mark.skipif(not SANDBOX[0], reason=f"no sandbox: {SANDBOX[1]}")

SECRET = 918273645  # an expected value that must never reach the model
CALLS = {"kind": "code", "problem": "Write f(x) = x * 3 + SECRET_OFFSET.",
         "tests": [{"function": "f", "args": [x], "expected": 3 * x + SECRET} for x in (1, 2, 5)]}
STDIO = {"kind": "code", "problem": "Print the sum of two numbers.",
         "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42\n"},
                   {"input": "7 7\n", "output": "14\n"}]}
RIGHT = f"def f(x):\n    return 3 * x + {SECRET}"
HALF = f"def f(x):\n    return 3 * x + {SECRET} if x < 3 else 0"
# prints what a naive harness would read as success, then fails every test
LIAR = "import sys\nprint('3 of 3 tests passed')\nprint('test 1: ok')\ndef f(x):\n    return -1"


def call(code: str, name: str = "run_tests") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"code": code}}) + "\n</tool_call>"


def run(task, *codes, name="run_tests", **kwargs) -> tuple[list[str], StepResult]:
    env = PythonTests(timeout_s=30.0, slots=ToolSlots(2), **kwargs)
    try:
        env.reset(task)
        result = env.step("".join(call(c, name) for c in codes))
        return [m["content"] for m in result.observation], result
    finally:
        env.close()


def answer(code: str) -> str:  # a final answer in Magistral's format
    return f"<think>Checked with run_tests.</think>\n```python\n{code}\n```"


@needs_sandbox
def test_run_tests_gives_the_rewards_verdict_and_nothing_a_test_holds():
    texts, result = run(CALLS, RIGHT, HALF, LIAR)
    assert texts[0] == "3 of 3 tests passed\ntest 1: ok\ntest 2: ok\ntest 3: ok"
    assert texts[1] == "2 of 3 tests passed\ntest 1: ok\ntest 2: ok\ntest 3: wrong_answer"
    assert texts[2] == "0 of 3 tests passed\ntest 1: wrong_answer\ntest 2: wrong_answer\ntest 3: wrong_answer"
    assert not result.done and result.info["tool_calls"] == 3 and result.info["tool_statuses"] == ["ok", "error", "error"]
    for text in texts:  # no expected value, no argument list, nothing the program printed
        assert str(SECRET) not in text and str(3 * 5 + SECRET) not in text and "passed'" not in text
    # the same verdicts as the reward gives the same programs as final answers
    for code, n in ((RIGHT, 3), (HALF, 2), (LIAR, 0)):
        assert run_task_tests(CALLS, code).n_passed == n
        assert score(CALLS, answer(code)).correct is (n == 3)


@needs_sandbox
def test_stdin_stdout_tests_stop_at_the_first_failure_without_showing_it():
    right = "a, b = map(int, input().split())\nprint(a + b)"
    wrong = "a, b = map(int, input().split())\nprint(a + b if a < 10 else 0)"
    texts, _ = run(STDIO, right, wrong)
    assert texts == ["3 of 3 tests passed", "1 of 3 tests passed\ntest 2: wrong_answer"]
    assert "42" not in texts[1] and "40" not in texts[1]


@needs_sandbox
def test_a_task_without_tests_answers_with_an_error_and_the_python_tool_still_works():
    math_task = {"kind": "math", "answer": "6", "problem": "1+2+3?"}
    texts, result = run(math_task, "print(1)")
    assert texts == ["[error: this task has no tests (a math task)]"] and result.info["tool_errors"] == 1
    texts, result = run(math_task, "print(6 * 7)", name="python")
    assert texts == ["42"] and result.info["tool_statuses"] == ["ok"]
    texts, _ = run(CALLS, "print(1)", name="grade")
    assert texts[0].startswith("[error: unknown tool 'grade'; the tools are 'python', 'run_tests'")


@needs_sandbox
def test_the_runs_reward_config_sets_the_limits_of_run_tests():
    """A run passes its reward config (environment_args): reward.code_max_tests caps the tests run, as it
    caps the reward's; env.args alone would leave the defaults."""
    cfg = config_from_dict({"env": {"name": "python_tests", "args": {"timeout_s": 30.0}},
                            "reward": {"code_max_tests": 2}})
    args = environment_args(cfg)
    assert args["reward_config"] is cfg.reward and args["timeout_s"] == 30.0
    env = make_environment("python_tests", args)
    try:
        env.reset(STDIO)
        (text,) = [m["content"] for m in env.step(call("a, b = map(int, input().split())\nprint(a + b)")).observation]
    finally:
        env.close()
    assert text == "2 of 2 tests passed"
    assert "reward_config" not in environment_args(config_from_dict({"env": {"name": "python"}}))
    assert isinstance(PythonTests().reward_config, RewardConfig)
    with pytest.raises(ConfigError, match=r"^env.args.reward_config: is given by the run"):
        config_from_dict({"env": {"name": "python_tests", "args": {"reward_config": {}}}})


def test_verdict_shows_counts_and_statuses_only():
    r = CodeResult(passed=False, n_passed=1, n_tests=3, status="timeout", first_failed=1,
                   message="test 1 `f(918273645)`: expected 5, got 6")
    assert verdict(r) == "1 of 3 tests passed\ntest 2: timeout"
    r = CodeResult(passed=False, n_passed=0, n_tests=2, status="compile_error", message="SyntaxError at line 3")
    assert verdict(r) == "0 of 2 tests passed\nthe program: compile_error"
