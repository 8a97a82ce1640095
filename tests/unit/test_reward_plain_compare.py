"""The plain-data codec that carries results out of the sandbox (reward.plain) and the comparison done
outside it (reward.compare), in-process: no sandbox needed.

References: Python's own ``==`` on genuine built-in values and ``math.isclose`` at the stated
tolerance (rel 1e-9, abs 1e-9); a value round-trips when it equals itself and keeps its exact type."""
from __future__ import annotations

import collections
import enum
import json
import math
import random

import pytest

from megatron_rl.reward import plain
from megatron_rl.reward.compare import (
    FLOAT_ABS_TOL, FLOAT_REL_TOL, apply_wraps, check_result, plain_equal,
)

VALUES = [None, True, False, 0, -7, 2**63 - 1, -(2**63), 2**64 + 5, -(10**400), 0.0, -1.5, 1e300, float("inf"),
          "", "héllo\n\x00", b"\x00\xffbytes", [], [1, [2, [3]]], (), (1, "a", None), {1, 2}, frozenset({(1, 2), "x"}),
          {}, {"a": 1, 2: [3], (4, 5): {"n": None}, frozenset({1}): b"k"}, [(1, {2: {3: (4,)}})]]


def _types(v):
    """The exact type structure of a value (a round trip must keep it, not only ==)."""
    if isinstance(v, (list, tuple)):
        return (type(v), [_types(x) for x in v])
    if isinstance(v, dict):
        return (dict, sorted((repr(_types(k)), repr(_types(x))) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return (type(v), sorted(repr(_types(x)) for x in v))
    return type(v)


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_plain_values_round_trip_with_their_exact_types(value):
    line = plain.dumps(value)
    assert "\n" not in line
    back = plain.loads(line)
    assert back == value and _types(back) == _types(value)


def test_nan_round_trips_and_random_nested_values_round_trip():
    assert math.isnan(plain.loads(plain.dumps(float("nan"))))
    rng = random.Random(0)

    def gen(depth):
        kind = rng.randrange(9 if depth < 4 else 5)
        return [lambda: rng.randint(-2**70, 2**70), lambda: rng.random() * 1e6, lambda: str(rng.random()),
                lambda: rng.choice([None, True, False]), lambda: bytes(rng.randrange(256) for _ in range(3)),
                lambda: [gen(depth + 1) for _ in range(rng.randrange(4))],
                lambda: tuple(gen(depth + 1) for _ in range(rng.randrange(4))),
                lambda: {rng.randint(0, 9): gen(depth + 1) for _ in range(rng.randrange(4))},
                lambda: frozenset(rng.randint(0, 99) for _ in range(rng.randrange(4)))][kind]()

    for _ in range(300):
        v = gen(0)
        assert plain.loads(plain.dumps(v)) == v


def test_subclasses_travel_as_their_base_value_and_overrides_stay_behind():
    class Liar(str):
        def __eq__(self, other):
            return True

        __hash__ = str.__hash__

    class Color(enum.IntEnum):
        RED = 3

    Point = collections.namedtuple("Point", "x y")
    for value, base in [(Liar("no"), "no"), (Color.RED, 3), (Point(1, 2), (1, 2)),
                        (collections.OrderedDict(a=1), {"a": 1}), (collections.Counter("aab"), {"a": 2, "b": 1})]:
        back = plain.loads(plain.dumps(value))
        assert back == base and type(back) is type(base)
    assert plain.loads(plain.dumps(Liar("no"))) != "yes"  # the decoded str has str's own __eq__


@pytest.mark.parametrize("bad", [object(), lambda: 1, 1j, iter([1]), range(3), {1: object()}, [[object()]]],
                         ids=lambda v: type(v).__name__)
def test_non_plain_values_are_refused(bad):
    with pytest.raises(plain.PlainError):
        plain.encode(bad)


def test_cycles_and_depth_are_refused_on_both_sides():
    cyc = []
    cyc.append(cyc)
    with pytest.raises(plain.PlainError, match="contains itself"):
        plain.encode(cyc)
    deep = []
    for _ in range(plain.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(plain.PlainError, match="deeper"):
        plain.encode(deep)
    # a hostile frame: nesting deep enough to break the JSON parser, or just past our limit
    for text in ["[" * 200000 + "]" * 200000, json.dumps(json.loads("[" * 150 + "]" * 150))]:
        with pytest.raises(plain.PlainError):
            plain.loads(text)


def test_sets_of_colliding_hashes_are_refused_fast(monkeypatch):
    """Ints hash modulo 2**61 - 1: a result of thousands of colliding ints would make building the set
    quadratic in the verifier (seconds per result); it is refused after one hash per element, before any
    set or dict of the elements is built (building one here fails the test)."""
    colliding = [1 + i * (2**61 - 1) for i in range(20000)]
    assert len({hash(x) for x in colliding}) == 1

    def built(*_):
        raise AssertionError("the colliding elements were put in a set")

    texts = [plain.dumps(colliding).replace("[", '{"set":[', 1) + "}",
             json.dumps({"dict": [[plain.encode(x), 0] for x in colliding]})]
    with monkeypatch.context() as m:
        m.setattr(plain, "set", built, raising=False)
        m.setattr(plain, "frozenset", built, raising=False)
        for text in texts:
            with pytest.raises(plain.PlainError, match="repeat the hash value"):
                plain.loads(text)
    ok, why = check_result(colliding, "eq", {1}, FLOAT_REL_TOL, FLOAT_ABS_TOL, (("set", ()),))
    assert not ok and "repeat the hash value" in why
    few = [1 + i * (2**61 - 1) for i in range(plain.MAX_SHARED_HASHES + 1)]
    assert plain.loads(plain.dumps(set(few))) == set(few)  # a few collisions are legitimate values


@pytest.mark.parametrize("text", ['{"tuple": 1}', '{"set": [[1]]}', '{"dict": [[1]]}', '{"dict": [[[1], 2]]}',
                                  '{"bytes": "***"}', '{"int": "zz"}', '{"list": []}', '{"tuple": [], "set": []}',
                                  '{"__eq__": 1}', '[1, {"x": 2}]', "1" * 5000, "not json", ""])
def test_invalid_encodings_are_refused(text):
    with pytest.raises(plain.PlainError):
        plain.loads(text)


# ------------------------------------------------------------------------------------------ comparison

def _lists(v):
    """Tuples made lists, recursively: the sequence rule (list and tuple interchangeable) for the reference."""
    if isinstance(v, (list, tuple)):
        return [_lists(x) for x in v]
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return v


# Exact values (no float on either side): the reference is Python's == after tuples become lists.
EXACT = [(3, 3), (True, 1), (2, True), (2**53 + 1, 2**53), ([1, 2], (1, 2)), ((1, [2, 3]), [1, (2, 3)]),
         ([1, 2], [2, 1]), ([1], [1, 1]), ({1, 2}, frozenset({2, 1})), ({1, 2}, [1, 2]), ({1, 2}, {1, 3}),
         ({"a": [1, 2]}, {"a": (1, 2)}), ({"a": 1}, {"b": 1}), ({"a": 1}, [("a", 1)]), (None, None), (None, 0),
         (None, []), ("", None), ("a", "a"), ("a", "A"), ("1", 1), (b"a", "a"), (b"a", b"a"),
         ([[1, [2, {"k": (3,)}]]], ((1, [2, {"k": [3]}]),)), ([[1, [2, {"k": (3,)}]]], [[1, [2, {"k": [4]}]]])]
# A float on one side at least: the reference is math.isclose at the stated tolerance, NaN equal to NaN.
FLOATS = [(0.1 + 0.2, 0.3), (1e-10, 0.0), (1.0000001, 1.0), (1e20 + 1e5, 1e20), (3, 3.0), (True, 1.0),
          (float("nan"), float("nan")), (float("nan"), 1.0), (float("inf"), float("inf")), (float("inf"), 1e308),
          (-0.0, 0.0), (7, 7.5)]


@pytest.mark.parametrize("got,expected", EXACT, ids=[str(i) for i in range(len(EXACT))])
def test_exact_values_compare_as_python_does_with_list_and_tuple_alike(got, expected):
    reference = _lists(got) == _lists(expected)
    decoded = plain.loads(plain.dumps(got))  # what the verifier really compares
    assert plain_equal(decoded, expected) == plain_equal(expected, decoded) == reference


@pytest.mark.parametrize("got,expected", FLOATS, ids=[str(i) for i in range(len(FLOATS))])
def test_floats_compare_with_the_stated_tolerance(got, expected):
    g, e = float(got), float(expected)
    reference = (math.isnan(g) and math.isnan(e)) or math.isclose(g, e, rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_ABS_TOL)
    assert plain_equal(plain.loads(plain.dumps(got)), expected) == plain_equal(expected, got) == reference


def test_tolerance_applies_inside_nested_structures_and_huge_ints_stay_exact():
    x = 1234.5678
    near, far = x * (1 + 0.5 * FLOAT_REL_TOL), x * (1 + 2 * FLOAT_REL_TOL)
    assert plain_equal({"k": [(near, 1)]}, {"k": ((x, 1),)}) and not plain_equal({"k": [(far, 1)]}, {"k": ((x, 1),)})
    assert not plain_equal({near}, {x})  # set elements are exact (hashing)
    assert plain_equal(10**400, 10**400) and not plain_equal(10**400, 1e308)  # no OverflowError


def test_float_tolerance_is_the_stated_one():
    x = 1234.5678
    assert plain_equal(x * (1 + 0.9 * FLOAT_REL_TOL), x) and not plain_equal(x * (1 + 1.1 * FLOAT_REL_TOL), x)
    assert plain_equal(0.9 * FLOAT_ABS_TOL, 0.0) and not plain_equal(1.1 * FLOAT_ABS_TOL, 0.0)
    assert plain_equal(1.5, 1.6, rel_tol=0.0, abs_tol=0.2) and not plain_equal(1.5, 1.8, rel_tol=0.0, abs_tol=0.2)
    assert not plain_equal(2**53 + 1, 2**53)  # ints compare exactly


def test_expectations_and_wraps_match_python_on_genuine_values():
    cases = [  # (result, op, expected, wraps, the Python expression that decides it)
        ([3, 1, 2], "eq", [1, 2, 3], (("sorted", ()),), lambda r: sorted(r) == [1, 2, 3]),
        ([3, 1, 1], "eq", {1, 3}, (("set", ()),), lambda r: set(r) == {1, 3}),
        (0.33333, "eq", 0.33, (("round", (2,)),), lambda r: round(r, 2) == 0.33),
        ("abc", "eq", 3, (("len", ()),), lambda r: len(r) == 3),
        (1, "is", True, (), lambda r: r is True),
        (True, "is", True, (), lambda r: r is True),
        (None, "is", None, (), lambda r: r is None),
        ([], "falsy", None, (), lambda r: not r),
        ([0], "truthy", None, (), lambda r: bool(r)),
        (4, "in", [1, 4], (), lambda r: r in [1, 4]),
        (5, "ne", 4, (), lambda r: r != 4),
        ((1, 2), "ne", [1, 2], (), lambda r: False),  # a tuple equals the list under these rules
        ([1, "a"], "eq", None, (("sorted", ()),), lambda r: False),  # sorted raises: the assert would too
    ]
    for result, op, expected, wraps, python in cases:
        ok, why = check_result(plain.loads(plain.dumps(result)), op, expected, FLOAT_REL_TOL, FLOAT_ABS_TOL, wraps)
        assert ok == python(result), (result, op, expected, why)
        assert ok or why
    assert apply_wraps([2, 1, 2], (("set", ()), ("sorted", ()))) == [1, 2]


def test_an_expected_int_beyond_float_precision_needs_the_exact_value():
    """A large count computed through floats (exp(lgamma(...))) is not the count: as Python's == says,
    once the expected int is past 2**53; below it the float tolerance stands."""
    count = math.comb(100, 50)  # 100891344545564193334812497256
    approx = math.exp(math.lgamma(101) - 2 * math.lgamma(51))
    assert math.isclose(approx, count, rel_tol=FLOAT_REL_TOL)  # what the old rule accepted
    assert not plain_equal(approx, count) and (approx == count) is False
    assert plain_equal(float(2**60), 2**60) == (float(2**60) == 2**60) is True  # a float that is exactly it
    assert plain_equal(float(count), count) == (float(count) == count)
    assert plain_equal(2.9999999999999996, 3) and plain_equal(approx, float(count))  # small ints, float expected
