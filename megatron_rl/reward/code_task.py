"""A program graded on a code task's tests, whichever kind they are: stdin/stdout programs
(reward.code.run_tests) or Python function calls (reward.calls.run_call_tests), under the code limits
of the reward config. reward.score calls it after its format gate; a tool environment that holds a
program rather than a response (e.g. one that runs the task's tests mid-episode) calls it directly
and grades exactly as the reward does.
"""
from __future__ import annotations

from typing import Any

from megatron_rl.config import RewardConfig
from megatron_rl.reward.calls import run_call_tests
from megatron_rl.reward.code import CodeLimits, CodeResult, run_tests
from megatron_rl.reward.types import CodeTask, TaskError, parse_task


def run_task_tests(task: dict[str, Any] | CodeTask, code: str, config: RewardConfig | None = None) -> CodeResult:
    """``code`` run on the task's tests (at most reward.code_max_tests; all must pass for ``passed``).
    TaskError for a task that is not a valid code task; TestFormError for test code that fails to run."""
    parsed = parse_task(task)
    if not isinstance(parsed, CodeTask):
        raise TaskError(f"a code task is needed, got kind {parsed.kind!r}", "kind")
    limits = CodeLimits.from_config(config if config is not None else RewardConfig())
    if parsed.calls is not None:  # function calls: one sandboxed process, results compared outside it
        return run_call_tests(code, parsed.calls, limits=limits)
    return run_tests(code, list(parsed.tests[:limits.max_tests]), parsed.language, limits=limits)
