"""The records of function-call tests: one call with its expectation (`CallTest`), assert code that
must run to yield its calls (`Expansion`), and a task's tests in order (`CallSuite`).

Parsing lives in reward.call_tests (the task schema) and reward.asserts (assert code); running in
reward.calls. Every value held here is plain data (reward.plain): arguments go into the sandbox,
expected values never do.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.reward.compare import FLOAT_ABS_TOL, FLOAT_REL_TOL, OPS, WRAPS

# "f", or "Class.method": a fresh Class() per call (LeetCode's Solution().method(...))
TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?")


class TestFormError(ValueError):
    """A function-call test that cannot be graded as written (one line: which test, what is wrong)."""

    __test__ = False  # not a pytest class


@dataclass(frozen=True)
class CallTest:
    """Call ``target(*args, **kwargs)`` in the sandbox, then check ``op`` against ``expected`` in the
    verifier (reward.compare.check_result), after applying ``wraps`` to the result."""

    target: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    op: str = "eq"
    expected: Any = None
    rel_tol: float = FLOAT_REL_TOL
    abs_tol: float = FLOAT_ABS_TOL
    wraps: tuple[tuple[str, tuple], ...] = ()  # (built-in name, extra args), innermost first
    source: str = ""  # the test as written, for messages

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not TARGET.fullmatch(self.target):
            raise TestFormError(f"function {self.target!r} must be a name or Class.method")
        if self.op not in OPS:
            raise TestFormError(f"unknown expectation {self.op!r} (one of {list(OPS)})")
        if self.op == "is" and not any(self.expected is v for v in (True, False, None)):
            raise TestFormError("'is' compares with True, False or None only")
        if self.op == "in" and not isinstance(self.expected, (list, tuple, set, frozenset, dict)):
            raise TestFormError(f"'in' needs a container of allowed results, got {type(self.expected).__name__}")
        for name in ("rel_tol", "abs_tol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise TestFormError(f"{name} must be a number >= 0, got {value!r}")
        if any(name not in WRAPS for name, _ in self.wraps):
            raise TestFormError(f"a result may only pass through {sorted(WRAPS)}")

    def call(self) -> dict[str, Any]:
        """What the sandbox receives: the call only, never the expectation."""
        return {"target": self.target, "args": list(self.args), "kwargs": dict(self.kwargs)}


@dataclass(frozen=True)
class Form:
    """One accepted assert of code that must run (`Expansion`): what the assert checks; its values
    (arguments, expected value, tolerances, extra arguments of wraps) come from running the code."""

    target: str
    op: str
    wraps: tuple[str, ...]
    tolerance: str  # default | abs | isclose (reward.asserts.tolerances)
    source: str


@dataclass(frozen=True)
class Expansion:
    """Assert code whose values need running it (loops, variables, helper functions): ``program`` is
    the code with each accepted assert replaced by a recording call (reward.asserts); it runs in the
    sandbox without the candidate (reward.expand) and yields one CallTest per executed assert."""

    program: str
    forms: tuple[Form, ...]
    targets: tuple[str, ...]  # names bound to a stub that refuses any other use of the function
    check: str | None  # "check" for `def check(candidate)`: called with the function under test
    test_functions: tuple[str, ...]  # pytest-style `def test_*()`: called in order


@dataclass(frozen=True)
class CallSuite:
    """A task's function-call tests in order: ready CallTests, and Expansions run at grading time."""

    parts: tuple[tuple[CallTest, ...] | Expansion, ...]
