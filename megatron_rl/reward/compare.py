"""Comparison of a function-call result with its expected value, done in the verifier (trusted) on
decoded plain data (reward.plain): nothing of the candidate's runs here.

Equality (``plain_equal``), the rules users of assert-based tests expect, recursively:
- numbers (bool, int, float) compare as numbers, as Python's ``==`` does (``True == 1``, ``3 == 3.0``);
  when either side is a float, they are equal when ``math.isclose(got, expected, rel_tol, abs_tol)``
  holds, by default rel_tol = abs_tol = 1e-9 (``FLOAT_REL_TOL`` / ``FLOAT_ABS_TOL``); NaN equals NaN and
  an infinity only itself; ints alone compare exactly, however large, and so does an expected int
  beyond 2**53, where floats no longer hold every integer (a float approximation of a large count,
  ``exp(lgamma(...))``, is not the count: Python's ``==`` says so too);
- str with str, bytes with bytes: exactly (a str never equals bytes);
- list and tuple are interchangeable sequences: equal length, elements equal in order;
- set and frozenset: the same elements (Python set equality, exact: no float tolerance inside sets);
- dict: the same keys (Python key equality), values equal under these rules;
- None equals only None; any other pair of types is unequal.

A test can also apply a few built-ins to the result before comparing (``set(f(x)) == {...}``,
``round(f(x), 2) == 0.33``): ``apply_wraps`` runs them here, on the decoded value, never in the sandbox,
so a candidate that patches ``set`` or ``sorted`` in its own process changes nothing.
"""
from __future__ import annotations

import math
from typing import Any

from megatron_rl.reward.plain import check_hashes

FLOAT_REL_TOL = 1e-9
FLOAT_ABS_TOL = 1e-9
_NUMBER = (bool, int, float)
_FLOAT_EXACT = 2 ** 53
_SEQUENCE = (list, tuple)
_SETS = (set, frozenset)

# Built-ins a test may apply to a result (by name), evaluated in the verifier on plain data.
WRAPS = {f.__name__: f for f in (set, frozenset, sorted, list, tuple, len, abs, round, sum, min, max,
                                 str, int, float, bool)}
# The operators an expectation may use (call_tests.CallTest.op).
OPS = ("eq", "ne", "is", "truthy", "falsy", "in", "returns")


def _exact_int(value: Any) -> bool:
    """An int that a float may not stand for: beyond 2**53 most integers have no float."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > _FLOAT_EXACT


def plain_equal(got: Any, expected: Any, rel_tol: float = FLOAT_REL_TOL, abs_tol: float = FLOAT_ABS_TOL) -> bool:
    """Equality of two decoded plain values under the rules of this module's docstring."""
    if isinstance(got, _NUMBER) and isinstance(expected, _NUMBER):
        if (isinstance(got, float) or isinstance(expected, float)) and not _exact_int(expected):
            try:
                if math.isnan(got) or math.isnan(expected):
                    return math.isnan(got) and math.isnan(expected)
                return math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)
            except OverflowError:  # an int beyond float range: Python's exact comparison
                return got == expected
        return got == expected
    if isinstance(got, _SEQUENCE) and isinstance(expected, _SEQUENCE):
        return len(got) == len(expected) and all(plain_equal(g, e, rel_tol, abs_tol) for g, e in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(plain_equal(got[k], expected[k], rel_tol, abs_tol)
                                                     for k in expected)
    if isinstance(got, _SETS) and isinstance(expected, _SETS):
        return got == expected
    if type(got) is not type(expected) or not isinstance(got, (str, bytes, type(None))):
        return False
    return got == expected


def apply_wraps(value: Any, wraps: tuple[tuple[str, tuple], ...]) -> Any:
    """``value`` passed through the named built-ins, innermost first: (("set", ()),) is set(value),
    (("round", (2,)),) is round(value, 2). Raises what the built-in raises (a failed test)."""
    for name, extra in wraps:
        if name in ("set", "frozenset") and isinstance(value, (list, tuple)):
            check_hashes(value, name)  # a set of colliding ints would cost O(n^2) here
        value = WRAPS[name](value, *extra)
    return value


def describe(value: Any, limit: int = 120) -> str:
    """A short repr for messages (the value is plain data: its repr runs no candidate code)."""
    try:
        text = repr(value)
    except ValueError:  # an int past the decimal-digit limit of int -> str
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[:limit] + "..."


def check_result(got: Any, op: str, expected: Any, rel_tol: float, abs_tol: float,
                 wraps: tuple[tuple[str, tuple], ...] = ()) -> tuple[bool, str]:
    """(passed, why not) for a decoded result under one expectation (call_tests.CallTest)."""
    try:
        value = apply_wraps(got, wraps)
    except Exception as e:  # noqa: BLE001 -- any error of a built-in on the result fails the test, as the assert would
        return False, f"{'/'.join(n for n, _ in wraps)} of the result raised {type(e).__name__}: {str(e)[:80]}"
    if op == "eq":
        ok = plain_equal(value, expected, rel_tol, abs_tol)
    elif op == "ne":
        ok = not plain_equal(value, expected, rel_tol, abs_tol)
    elif op == "is":
        ok = value is expected  # expected is True, False or None: decoded singletons
    elif op == "truthy" or op == "falsy":
        ok = bool(value) == (op == "truthy")
    elif op == "in":
        ok = any(plain_equal(value, e, rel_tol, abs_tol) for e in expected)
    elif op == "returns":
        ok = True  # any plain result: the test only asks that the call returns
    else:
        raise ValueError(f"unknown op {op!r}")
    return ok, "" if ok else f"{op} {describe(expected)}: got {describe(value)}"
