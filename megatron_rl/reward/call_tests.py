"""The function-call tests of a code task (``task["tests"]`` for Python), as the task schema accepts
them (reward.types), parsed into a CallSuite (reward.call_types):

- a list of call tests, each one of
  ``{"function": "add", "args": [1, 2], "kwargs": {}, "expected": 3}`` (``function`` defaults to the
  task's ``entry_point``; ``"Solution.twoSum"`` calls a fresh ``Solution()``'s method),
  ``{"call": "Solution().twoSum([2, 7, 11, 15], 9)", "expected": [0, 1]}`` (literal arguments), with
  optional ``rel_tol`` / ``abs_tol`` for float results (defaults: reward.compare);
- assert code (reward.asserts): a string, or strings in that list (MBPP's ``test_list``), e.g.
  ``"assert add(1, 2) == 3"`` or HumanEval's ``def check(candidate): ...`` (with ``entry_point``).

Stdin/stdout tests are a list of ``{"input", "output"}`` dicts; `is_call_tests` tells the two apart.
Keys a parquet row fills with null are ignored, except ``expected`` (null is None). A malformed test is
a TestFormError naming its index and key.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from megatron_rl.reward.asserts import build_test, convert, parse_call
from megatron_rl.reward.call_types import CallSuite, CallTest, Expansion, TestFormError
from megatron_rl.reward.compare import FLOAT_ABS_TOL, FLOAT_REL_TOL

_KEYS = {"call", "function", "args", "kwargs", "expected", "rel_tol", "abs_tol"}


def is_call_tests(tests: Any) -> bool:
    """True for function-call tests: assert code, or a list whose first item is not a stdin/stdout test."""
    if isinstance(tests, str):
        return True
    if not isinstance(tests, (list, tuple)) or not tests:
        return False
    first = tests[0]
    return not (isinstance(first, dict) and ("input" in first or "output" in first))


def parse_call_tests(tests: Any, entry_point: str | None = None) -> CallSuite:
    """The CallSuite of a task's function-call tests; TestFormError (one line) for a malformed one."""
    if isinstance(tests, str):
        return CallSuite((_assert_code(tests, entry_point),))
    if not isinstance(tests, (list, tuple)) or not tests:
        raise TestFormError("tests must be assert code or a non-empty list of call tests")
    parts: list[tuple[CallTest, ...] | Expansion] = []
    for i, item in enumerate(tests):
        try:
            part = _assert_code(item, entry_point) if isinstance(item, str) else (_dict_test(item, entry_point),)
        except TestFormError as e:
            raise TestFormError(f"tests[{i}]: {e}") from None
        if isinstance(part, tuple) and parts and isinstance(parts[-1], tuple):
            parts[-1] += part
        else:
            parts.append(part)
    return CallSuite(tuple(parts))


@lru_cache(maxsize=1024)
def _assert_code(text: str, entry_point: str | None) -> tuple[CallTest, ...] | Expansion:
    return convert(text, entry_point)


def _dict_test(item: Any, entry_point: str | None) -> CallTest:
    if not isinstance(item, dict):
        raise TestFormError(f"a call test is a dict or assert code, got {type(item).__name__}")
    item = {k: v for k, v in item.items() if v is not None or k == "expected"}  # parquet nulls
    unknown = sorted(set(item) - _KEYS)
    if unknown:
        raise TestFormError(f"unknown key(s) {unknown} (a call test has {sorted(_KEYS)})")
    if "expected" not in item:
        raise TestFormError("'expected' is missing (null means the call returns None)")
    target, args, kwargs = _call_of(item, entry_point)
    tols = (item.get("rel_tol", FLOAT_REL_TOL), item.get("abs_tol", FLOAT_ABS_TOL))
    source = item.get("call") or f"{target}(*{args!r:.60}, **{kwargs!r:.40})"
    return build_test(target, "eq", args, kwargs, item["expected"], tols, [], source)


def _call_of(item: dict, entry_point: str | None) -> tuple[str, list, dict]:
    if "call" in item:
        if not isinstance(item["call"], str) or {"function", "args", "kwargs"} & set(item):
            raise TestFormError("'call' is a string such as \"f(1, 2)\", given without function/args/kwargs")
        return parse_call(item["call"])
    target = item.get("function", entry_point)
    if target is None:
        raise TestFormError("'function' is missing and the task has no entry_point")
    args, kwargs = item.get("args", []), item.get("kwargs", {})
    if not isinstance(args, (list, tuple)):
        raise TestFormError(f"'args' must be a list of arguments, got {type(args).__name__}")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TestFormError("'kwargs' must be a dict with string keys")
    return target, list(args), dict(kwargs)
