"""Format gate: one <think> block, then \\boxed{} (math) or a fenced block in the task's language."""
from __future__ import annotations

import random
import re
import time

import pytest

from megatron_rl.reward.format import LANGUAGE_TAGS, boxed_contents, check_format, fenced_blocks, split_think
from megatron_rl.reward.types import parse_task

MATH = parse_task({"kind": "math", "answer": "3"})
PY = parse_task({"kind": "code", "language": "python", "tests": [{"input": "", "output": "1\n"}]})
CPP = parse_task({"kind": "code", "language": "cpp", "tests": [{"input": "", "output": "1\n"}]})


def test_well_formed_math_splits_thoughts_and_answer():
    r = check_format(MATH, "  \n<think>2+1 is 3</think>\nSo the answer is $\\boxed{3}$.")
    assert r.ok and r.reason == ""
    assert r.thoughts == "2+1 is 3"
    assert r.answer == "\nSo the answer is $\\boxed{3}$."


@pytest.mark.parametrize("response, reason", [
    ("The answer is \\boxed{3}", "exactly one"),
    ("<think>a</think><think>b</think>\\boxed{3}", "exactly one"),
    ("<think>a <think> b</think>\\boxed{3}", "exactly one"),
    ("<think>never closed \\boxed{3}", "exactly one"),
    ("</think>oops<think>\\boxed{3}", "before"),
    ("Sure! <think>a</think>\\boxed{3}", "text before"),
    ("<think>   </think>\\boxed{3}", "empty thoughts"),
    ("<think>thinking</think>\n  ", "nothing after"),
])
def test_think_block_violations(response, reason):
    r = check_format(MATH, response)
    assert not r.ok and reason in r.reason


@pytest.mark.parametrize("answer, ok", [
    ("\\boxed{3}", True),
    ("\\boxed {3}", True),
    ("\\boxed{\\frac{1}{2}} then \\boxed{x}", True),
    ("3", False),
    ("\\boxed{}", False),
    ("\\boxed{  }", False),
    ("\\boxed{3", False),  # unbalanced
    ("\\fbox{3}", False),  # the gate asks for \boxed (Magistral)
])
def test_math_needs_nonempty_boxed_in_answer(answer, ok):
    assert check_format(MATH, f"<think>t</think>{answer}").ok is ok


def test_box_only_inside_thoughts_fails():
    assert not check_format(MATH, "<think>maybe \\boxed{3}</think>The answer is 3.").ok


def test_boxed_contents_matches_reference_on_random_nested_braces():
    rng = random.Random(0)

    def balanced(depth):  # an independent generator of balanced brace strings
        out = []
        for _ in range(rng.randint(0, 3)):
            out.append(rng.choice(["x", "1", "+", "\\frac", " "]))
            if depth < 4 and rng.random() < 0.5:
                out.append("{" + balanced(depth + 1) + "}")
        return "".join(out)

    for _ in range(200):
        parts = [balanced(0) for _ in range(rng.randint(1, 3))]
        text = " and ".join(f"\\boxed{{{p}}}" for p in parts)
        assert boxed_contents(text) == parts
    assert boxed_contents(r"\boxed{a\{b}") == [r"a\{b"]  # escaped braces do not close the box


def test_code_block_with_task_language():
    resp = "<think>sum</think>\nHere:\n```python\nprint(1)\n```\n"
    r = check_format(PY, resp)
    assert r.ok and r.code == "print(1)"
    assert check_format(PY, resp.replace("```python", "```py")).ok
    assert check_format(CPP, resp.replace("```python", "```c++")).ok
    assert not check_format(CPP, resp).ok  # a python block does not answer a cpp task


@pytest.mark.parametrize("answer", [
    "```\nprint(1)\n```",  # no language tag
    "```python\nprint(1)\n",  # never closed
    "```python\n```",  # empty
    "print(1)",  # no fence
    "```javascript\nconsole.log(1)\n```",
])
def test_code_format_failures(answer):
    assert not check_format(PY, f"<think>t</think>\n{answer}").ok


def test_last_matching_block_is_the_program_and_thought_blocks_do_not_count():
    resp = ("<think>draft:\n```python\nprint(0)\n```\n</think>\n```python\nprint(1)\n```\n"
            "```cpp\nint main(){}\n```\n```python\nprint(2)\n```")
    r = check_format(PY, resp)
    assert r.ok and r.code == "print(2)"
    assert fenced_blocks(r.answer) == [("python", "print(1)"), ("cpp", "int main(){}"), ("python", "print(2)")]
    assert not check_format(PY, "<think>\n```python\nprint(0)\n```\n</think>done").ok


def test_split_think_returns_reason_string():
    assert split_think("<think>a</think>b") == ("a", "b")
    assert isinstance(split_think("no tags"), str)


_FENCE_SPEC = re.compile(r"^[ \t]*```[ \t]*([^\s`]*)[^\n]*\n(.*?)\n[ \t]*```[ \t]*$", re.M | re.S)


def test_fenced_blocks_follow_the_lazy_regex_spec_in_linear_time():
    """The spec is the lazy regex (quadratic on unclosed fences); fenced_blocks must agree with it."""
    def spec(text):
        return [(LANGUAGE_TAGS.get(m.group(1).lower(), m.group(1).lower()), m.group(2))
                for m in _FENCE_SPEC.finditer(text)]

    rng = random.Random(2)
    atoms = ["```", "```python", "```py x", " ```", "\t```\t", "````", "\n", "\n", "x", " ", "```cpp", "`", "\r"]
    for _ in range(3000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 16)))
        assert fenced_blocks(text) == spec(text), repr(text)
    hostile = "```python\nprint(1)\n" * 80000  # ~1.5 MB of fences that never close
    t = time.perf_counter()
    assert fenced_blocks(hostile) == [] and not check_format(PY, "<think>t</think>\n" + hostile).ok
    assert time.perf_counter() - t < 2.0
