"""Environments of multi-turn episodes: the contract (``base``), loading by name (``loading``), the cap
on concurrent tool runs (``slots``) and the built-ins: ``python`` (a tool that runs the model's code in
reward's bubblewrap sandbox), ``python_tests`` (that tool plus ``run_tests``: the task's own tests,
graded as the reward grades), ``single_turn`` (a single-turn task as a one-turn episode) and ``echo``
(scripted, for tests). The turn loop that drives them with tokens lives in ``megatron_rl.rollout``.

This package imports ``reward`` (the verifiers grade final answers; tools run in its sandbox); reward
never imports it.
"""
from megatron_rl.env.base import (Environment, EnvFailure, Message, StepResult, check_observation, outcome,
                                  own_reward, verdict)
from megatron_rl.env.loading import (
    BUILTINS, ENTRY_POINT_GROUP, EnvLoadError, environment_error, load_environment, make_environment,
)
from megatron_rl.env.python_tests import RUN_TESTS, PythonTests
from megatron_rl.env.python_tool import PYTHON_TOOL, PythonTool, ToolCall, parse_tool_calls
from megatron_rl.env.scripted import Echo
from megatron_rl.env.single_turn import SingleTurn
from megatron_rl.env.slots import ToolSlots, shared_slots

__all__ = ["Environment", "EnvFailure", "Message", "StepResult", "check_observation", "outcome", "own_reward",
           "verdict",
           "BUILTINS", "ENTRY_POINT_GROUP", "EnvLoadError", "environment_error", "load_environment",
           "make_environment", "PYTHON_TOOL", "PythonTool", "RUN_TESTS", "PythonTests", "ToolCall", "parse_tool_calls", "Echo",
           "SingleTurn", "ToolSlots", "shared_slots"]
