"""Assert code and call dicts -> function-call tests (reward.asserts, reward.call_tests), in-process.

The reference for every accepted form is Python itself: the assert, run with an honest implementation
of the function, passes exactly when our tests -- the converted calls, each result sent through the
plain-data codec and checked by reward.compare -- all pass. Refused forms name their line."""
from __future__ import annotations

import math

import pytest

from megatron_rl.reward import plain
from megatron_rl.reward.asserts import convert, parse_call
from megatron_rl.reward.call_tests import is_call_tests, parse_call_tests
from megatron_rl.reward.call_types import CallTest, Expansion, TestFormError
from megatron_rl.reward.compare import check_result
from megatron_rl.reward.types import CodeTask, TaskError, parse_task


class Solution:  # LeetCode's class form, for `Solution().add(...)`
    def add(self, a, b):
        return a + b


def _ours(tests: tuple[CallTest, ...], namespace: dict) -> bool:
    """Our verdict with the calls made in-process (the sandbox is tested elsewhere)."""
    for t in tests:
        owner, _, method = t.target.partition(".")
        fn = getattr(namespace[owner](), method) if method else namespace[owner]
        try:
            got = plain.loads(plain.dumps(fn(*t.args, **t.kwargs)))
        except Exception:  # noqa: BLE001 -- the call failed: the test fails
            return False
        if not check_result(got, t.op, t.expected, t.rel_tol, t.abs_tol, t.wraps)[0]:
            return False
    return True


def _python(code: str, namespace: dict) -> bool:
    """The assert code run as written."""
    try:
        exec(code, {"math": math, **namespace})
    except Exception:  # noqa: BLE001 -- AssertionError, or the expression raised
        return False
    return True


IMPLS = {  # honest implementations of f: right, wrong, wrong type, None
    "add": lambda a=0, b=0: a + b, "sub": lambda a=0, b=0: a - b, "float_add": lambda a=0, b=0: float(a + b),
    "tuple": lambda a=0, b=0: (a, b), "none": lambda a=0, b=0: None, "true": lambda a=0, b=0: True,
    "third": lambda a=0, b=1: a / b,
}
FORMS = [
    "assert f(2, 3) == 5", "assert 5 == f(2, 3)", "assert f(2, 3) != 6", "assert f(1, 1) is True",
    "assert f(0, 0) is None", "assert f(2, 3)", "assert not f(2, -2)", "assert f(2, 3) in [5, 6]",
    "assert abs(f(1, 2) - 3.0) < 1e-6", "assert abs(3.0 - f(1, 2)) <= 1e-6", "assert math.fabs(f(1, 2) - 3) < 1e-3",
    "assert math.isclose(f(1, 2), 3.0)", "assert math.isclose(f(1, 2), 3.3, rel_tol=0.2)",
    "from math import isclose\nassert isclose(3.0, f(1, 2), abs_tol=0.5)",
    "assert f(a=2, b=3) == 5", "assert f(2 * 3, 1) == 6 + 1", "assert f(2, -3) == -1", "assert f(1, 3) == 1 / 3",
    "assert round(f(1, 3), 2) == 0.33", "assert f(2, 3) == (2, 3)",
    "assert len(f(2, 3)) == 2", "assert sorted(f(3, 1)) == [1, 3]", "assert set(f(3, 3)) == set((3,))",
    "assert f(2, 3) == 5, 'got ' + str(f(2, 3))", "assert f(2, 3) == 5\nassert f(0, 0) == 0\nassert True, 'x'",
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert not candidate(0, 0)\n\ncheck(f)",
    "from solution import f\n\ndef test_one():\n    assert f(2, 3) == 5\n\ndef test_two():\n    assert f(1, 1) == 2",
]


@pytest.mark.parametrize("form", FORMS, ids=[str(i) for i in range(len(FORMS))])
def test_each_accepted_form_agrees_with_python_on_honest_functions(form):
    entry = "f" if "check" in form else None
    tests = convert(form, entry)
    assert isinstance(tests, tuple) and tests, "literal test code is converted without running anything"
    runnable = form.replace("from solution import f\n", "")
    runnable += "".join(f"\n{name}()" for name in ("test_one", "test_two") if f"def {name}" in form)
    for name, impl in IMPLS.items():
        ns = {"f": impl}
        assert _ours(tests, ns) == _python(runnable, ns), (form, name)


def test_the_one_rule_that_differs_from_python_list_equals_tuple():
    tests = convert("assert f(2, 3) == [2, 3]")
    assert _ours(tests, {"f": IMPLS["tuple"]}) and not _python("assert f(2, 3) == [2, 3]", {"f": IMPLS["tuple"]})
    assert not _ours(tests, {"f": lambda a, b: {a, b}})  # a set is no sequence


def test_class_form_and_self_comparison():
    tests = convert("assert Solution().add(2, 3) == 5\nassert Solution().add(1, 1) != 3")
    assert [t.target for t in tests] == ["Solution.add"] * 2 and _ours(tests, {"Solution": Solution})
    # HumanEval/33 compares the function with itself on the same input: only "it returns" is checked
    (t,) = convert("def check(candidate):\n    assert tuple(candidate([1])) == tuple(f([1]))\n", "f")
    assert (t.op, t.wraps, t.args) == ("returns", (("tuple", ()),), ([1],))
    assert _ours((t,), {"f": lambda xs: xs}) and not _ours((t,), {"f": lambda xs: 3})  # tuple(3) raises


@pytest.mark.parametrize("code,why", [
    ("x = f(1)\nassert x == 2", "line 1: `f` .*used outside an accepted assert"),
    ("assert f(1) + 1 == 3", "line 1: .*not an accepted form"),
    ("assert f(1) == f(2)", "not an accepted form"),
    ("assert f(f(1)) == 2", "appears in its own arguments"),
    ("assert f(1) == 2 == 2", "not an accepted form"),
    ("assert f(1) is 3", "not an accepted form"),
    ("assert isinstance(f(1), int)", "not an accepted form"),
    ("assert f(1) == 1\nassert False", "line 2: .*always fails"),
    ("def check(candidate):\n    assert candidate(1) == 2", "needs the entry point"),
    ("def test_x(tmp_path):\n    assert f(1) == 2", "pytest fixtures"),
    ("assert f(1 ==", "not valid Python"),
    ("print('no asserts')", "no assert on the function"),
    ("assert f(1) == 1j", "not plain data"),
    ("def check(candidate):\n    helper(candidate)\n    assert candidate(1) == 1", "line 2: `candidate`"),
])
def test_refused_forms_say_which_line_and_why(code, why):
    with pytest.raises(TestFormError, match=why):
        convert(code, "g" if "helper" in code else None)


def test_code_that_must_run_becomes_an_expansion_with_recording_calls():
    code = ("import random\ndef helper(n):\n    return n * 2\n\ndef check(candidate):\n    for i in range(3):\n"
            "        assert candidate(i) == helper(i)\n    xs = [random.randint(0, 9)]\n    assert sorted(candidate(*xs)) == xs\n")
    exp = convert(code, "double")
    assert isinstance(exp, Expansion) and exp.check == "check" and "candidate" in exp.targets
    assert [(f.target, f.op, f.wraps) for f in exp.forms] == [("double", "eq", ()), ("double", "eq", ("sorted",))]
    assert "__mrl__.call(0, i).expect(helper(i)" in exp.program and "assert candidate" not in exp.program
    compile(exp.program, "tests.py", "exec")  # the program the sandbox runs is valid Python


def test_call_dicts_and_call_strings():
    suite = parse_call_tests([{"function": "add", "args": [1, 2], "expected": 3},
                              {"call": "Solution().add(2, b=5)", "expected": 7, "abs_tol": 0.5},
                              {"args": [0, 0], "expected": 0, "call": None},  # a parquet null is absent
                              "assert add(4, 4) == 8"], entry_point="add")
    (tests,) = suite.parts
    assert [(t.target, t.args, t.kwargs, t.expected) for t in tests] == [
        ("add", (1, 2), {}, 3), ("Solution.add", (2,), {"b": 5}, 7), ("add", (0, 0), {}, 0), ("add", (4, 4), {}, 8)]
    assert tests[1].abs_tol == 0.5 and "expected" not in tests[0].call()
    assert parse_call("f()") == ("f", [], {})


@pytest.mark.parametrize("tests,why", [
    ([{"function": "f", "args": [1]}], r"tests\[0\]: 'expected' is missing"),
    ([{"function": "f", "args": 1, "expected": 1}], "'args' must be a list"),
    ([{"function": "f", "kwargs": {"1": 1, 2: 2}, "expected": 1}], "'kwargs' must be a dict with string keys"),
    ([{"args": [1], "expected": 1}], "'function' is missing and the task has no entry_point"),
    ([{"function": "a.b.c", "expected": 1}], "must be a name or Class.method"),
    ([{"call": "f(x)", "expected": 1}], "arguments must be literals"),
    ([{"call": "f(1)", "args": [1], "expected": 1}], "given without function/args/kwargs"),
    ([{"call": "1 + 2", "expected": 1}], r"must be f\(...\) or Class\(\).method"),
    ([{"function": "f", "expected": 1, "rel_tol": -1}], "rel_tol must be a number >= 0"),
    ([{"function": "f", "expected": 1, "tolerance": 1}], r"unknown key\(s\) \['tolerance'\]"),
    ([{"function": "f", "expected": 1}, 3], r"tests\[1\]: a call test is a dict or assert code"),
])
def test_malformed_call_tests_name_the_test_and_key(tests, why):
    with pytest.raises(TestFormError, match=why):
        parse_call_tests(tests)


def test_task_schema_tells_the_kinds_apart():
    assert not is_call_tests([{"input": "1", "output": "1"}]) and is_call_tests("assert f(1) == 1")
    assert is_call_tests([{"function": "f", "expected": 1}]) and not is_call_tests([])
    task = parse_task({"kind": "code", "tests": "def check(c):\n    assert c(1) == 1\n", "entry_point": "f"})
    assert isinstance(task, CodeTask) and task.calls is not None and task.tests == () and task.entry_point == "f"
    stdio = parse_task({"kind": "code", "tests": [{"input": "1", "output": "1"}]})
    assert stdio.calls is None and len(stdio.tests) == 1
    for bad, key in [({"kind": "code", "language": "cpp", "tests": "assert f(1) == 1"}, "tests"),
                     ({"kind": "code", "tests": "assert f(1) == 1", "entry_point": "not a name"}, "entry_point"),
                     ({"kind": "code", "tests": [{"function": "f"}]}, "tests")]:
        with pytest.raises(TaskError) as e:
            parse_task(bad)
        assert e.value.key == key and "\n" not in str(e.value)
