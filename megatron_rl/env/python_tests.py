"""The ``python_tests`` environment: the ``python`` tool, plus a ``run_tests`` tool that grades a program
on the task's own tests mid-episode, exactly as the final answer will be graded.

    <tool_call>
    {"name": "run_tests", "arguments": {"code": "def add(a, b):\\n    return a + b"}}
    </tool_call>

``run_tests`` runs ``code`` through :func:`megatron_rl.reward.code_task.run_task_tests`, the function
``reward.score`` grades a code answer with (function-call tests or stdin/stdout tests, in the reward's
sandbox, under the run's ``reward`` code limits: the environment is given the run's reward config). The
observation is the verdict only: how many tests passed and each test's status (``ok``,
``wrong_answer``, ``runtime_error``, ``timeout``, ...). It never shows a test's input, its expected value
or what the program printed, so the tool cannot leak the answers the reward checks (a model that saw them
could hard-code them), and output the program prints cannot pose as the verdict. A task without tests
(not a code task) answers each ``run_tests`` call with an error observation. Calls count toward
``max_tool_calls`` like ``python`` calls and share its slots; the final answer (a turn without a tool
call) is graded by ``reward.score`` as in the ``python`` environment.
"""
from __future__ import annotations

import time
from typing import Any

from megatron_rl.config import RewardConfig
from megatron_rl.env.base import EnvFailure, Message
from megatron_rl.env.python_tool import PYTHON_TOOL, PythonTool
from megatron_rl.reward.code_task import run_task_tests
from megatron_rl.reward.types import CodeTask, TaskError, parse_task

RUN_TESTS: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": (
            "Grade a complete solution on the task's tests, as the final answer will be graded. Returns how "
            "many tests passed and each test's status (ok, wrong_answer, runtime_error, timeout, ...), "
            "never the tests' inputs or expected values."),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The whole program or function(s)."}},
            "required": ["code"],
        },
    },
}


class PythonTests(PythonTool):
    """PythonTool with ``run_tests`` (module docstring). ``reward_config``: the run's reward config (its
    code limits and test count), given by the run; the defaults otherwise."""

    tools = [PYTHON_TOOL, RUN_TESTS]

    def __init__(self, *, reward_config: RewardConfig | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.reward_config = reward_config if reward_config is not None else RewardConfig()
        self.task: CodeTask | None = None
        self.no_tests = ""  # why run_tests cannot run on this task ("" = it can)

    def reset(self, task: dict[str, Any]) -> list[Message]:
        messages = super().reset(task)
        try:
            parsed = parse_task(task)
        except TaskError as e:
            parsed, self.no_tests = None, f"the task cannot be graded ({e})"
        if parsed is not None and not isinstance(parsed, CodeTask):
            self.no_tests = f"this task has no tests (a {parsed.kind} task)"
        self.task = parsed if isinstance(parsed, CodeTask) else None
        return messages

    def _call(self, name: str, code: str) -> tuple[str, str, float, float]:
        if name != RUN_TESTS["function"]["name"]:
            return super()._call(name, code)
        if self.task is None:
            return f"[error: {self.no_tests}]", "invalid", 0.0, 0.0
        with self.slots.hold() as waited:
            t0 = time.monotonic()
            result = run_task_tests(self.task, code, self.reward_config)
            wall = time.monotonic() - t0
        if not result.graded:
            raise EnvFailure(f"run_tests: the sandbox could not run the tests: {result.message}")
        return verdict(result), "ok" if result.passed else "error", wall, waited


def verdict(result) -> str:
    """The observation of one run_tests call: counts and statuses, nothing a test holds (module docstring)."""
    head = f"{result.n_passed} of {result.n_tests} tests passed"
    if result.test_statuses:  # function-call tests: each test's own status
        return head + "\n" + "\n".join(f"test {i + 1}: {s}" for i, s in enumerate(result.test_statuses))
    if result.passed:
        return head
    where = f"test {result.first_failed + 1}" if result.first_failed is not None else "the program"
    return f"{head}\n{where}: {result.status}"
