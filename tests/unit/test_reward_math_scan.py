"""Answer scanning in linear time (math.extract.BoxScan, format.boxed_contents / has_nonempty_box).

The reference here is an independent, deliberately naive scanner: for each box command it walks
forward character by character with a depth counter (quadratic, fine on short strings). The linear
scanner must agree with it on random strings, and must stay fast on 1 MB hostile responses (the
bound asserted is loose, 2 s, against the 0.2 s target: benchmarks/answer_scan.py prints the real
figures, old scan vs new, measured side by side)."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

from megatron_rl.reward.format import boxed_contents, check_format, has_nonempty_box
from megatron_rl.reward.math.extract import extract_answer, find_boxes, pair_braces
from megatron_rl.reward.types import parse_task


def _naive_close(s: str, i: int, end: int) -> int | None:
    depth = 0
    while i < end:
        if s[i] == "\\":
            i += 2
            continue
        depth += {"{": 1, "}": -1}.get(s[i], 0)
        if depth == 0:
            return i
        i += 1
    return None


def _naive_box(s: str, j: int, end: int):
    """(content, next index) of a box command at j read inside s[:end], else None."""
    for cmd in ("\\boxed", "\\fbox"):
        if s.startswith(cmd, j) and j + len(cmd) <= end:
            i = j + len(cmd)
            while i < end and s[i] in " \t\n":
                i += 1
            if i >= end:
                return None
            if s[i] == "{":
                c = _naive_close(s, i, end)
                return None if c is None else (s[i + 1:c], c + 1)
            if i == j + len(cmd) and s[i].isalpha():
                return None
            k = i
            while k < end and not s[k].isspace() and s[k] != "$":
                k += 1
            token = s[i:k].rstrip(".,;")
            return (token, k) if token else None
    return None


def naive_last_box(s: str) -> str | None:
    boxes, i = [], 0
    while i < len(s):
        got = _naive_box(s, i, len(s)) if s[i] == "\\" else None
        if got is None:
            i += 1
        else:
            boxes.append(got[0])
            i = got[1]
    if not boxes:
        return None
    ans = boxes[-1].strip()
    while (got := _naive_box(ans, 0, len(ans))) is not None and not ans[got[1]:].strip():
        ans = got[0].strip()
    return ans


def naive_gate(s: str) -> bool:
    """Some \\boxed, whitespace, {non-blank content} that closes."""
    for j in range(len(s)):
        if s.startswith("\\boxed", j):
            i = j + 6
            while i < len(s) and s[i].isspace():
                i += 1
            c = _naive_close(s, i, len(s)) if i < len(s) and s[i] == "{" else None
            if c is not None and s[i + 1:c].strip():
                return True
    return False


ATOMS = ["\\boxed{", "\\boxed ", "\\boxed", "\\fbox{", "}", " }", "{", "5", "x", ".", ";", " ", "\n",
         "$", "\\{", "\\}", "\\\\", "\\boxed\t{", "\u00e9", "\u2003", "\\boxedfoo", "a,"]


def test_scanners_match_naive_ones_on_random_strings():
    rng = random.Random(7)
    for _ in range(4000):
        s = "".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 24)))
        s += "}" * rng.randint(0, 6)
        assert extract_answer(s) == naive_last_box(s), repr(s)
        assert has_nonempty_box(s) == naive_gate(s), repr(s)


def test_pair_braces_matches_a_stack():
    rng = random.Random(3)
    for _ in range(3000):
        s = "".join(rng.choice("{}\\a") for _ in range(rng.randint(0, 40)))
        want, stack, i = [-1] * (len(s) + 1), [], 0
        while i < len(s):
            if s[i] == "\\":
                i += 2
                continue
            if s[i] == "{":
                stack.append(i)
            elif s[i] == "}" and stack:
                want[stack.pop()] = i
            i += 1
        codes = np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32)
        assert pair_braces(codes).tolist() == want, s


def test_gate_boxes_are_the_outermost_closed_ones():
    assert boxed_contents(r"\boxed{\boxed{1}} and \boxed{2") == [r"\boxed{1}"]
    assert boxed_contents("\\boxed\r\n{ 3 }") == [" 3 "]  # the gate allows any whitespace
    assert boxed_contents(r"\fbox{3} \boxed 4") == []  # the gate asks for \boxed{...}
    assert not has_nonempty_box("\\boxed{ } \\boxed{ \n }") and has_nonempty_box(r"\boxed{ } \boxed{0}")
    assert find_boxes(r"\boxed{a} \boxed{\boxed{b}} \fbox 7.") == ["a", r"\boxed{b}", "7"]


def _shapes(size: int) -> dict[str, str]:
    rep = lambda unit, tail="": unit * (size // len(unit)) + tail  # noqa: E731
    return {
        "unclosed": rep("The answer is \\boxed{"),
        "nested": "\\boxed{" * (size // 8) + "42" + "}" * (size // 8),
        "deep braces": "\\boxed{" + "{" * (size // 2) + "}" * (size // 2) + "}",
        "deep unclosed": rep("{", "\\boxed{1}"),
        "many boxes": rep("\\boxed{12} "),
        "fbox": rep("\\fbox{", "\\fbox{7}"),
        "unbalanced": rep("}", "\\boxed{3}") + rep("}\\boxed{")[: size // 4],
        "brace-less chain": rep("\\boxed", "{9}"),
        "many brace-less": rep("\\boxed 5. "),
    }


# the gate asks for \\boxed{...}: \\fbox and brace-less boxes do not pass it
GATE = {"unclosed": False, "nested": True, "deep braces": True, "deep unclosed": True, "many boxes": True,
        "fbox": False, "unbalanced": True, "brace-less chain": True,
        "many brace-less": False}
EXPECTED = {"unclosed": None, "nested": "42", "deep unclosed": "1", "many boxes": "12", "fbox": "7",
            "unbalanced": "", "brace-less chain": "9",
            "many brace-less": "5"}


@pytest.mark.parametrize("name", list(_shapes(64)))
def test_one_megabyte_hostile_responses_scan_fast(name):
    text = _shapes(1 << 20)[name]
    small = _shapes(4096)[name]
    assert extract_answer(small) == naive_last_box(small)  # same answer as the naive scan
    t = time.perf_counter()
    got = extract_answer(text)
    gate = has_nonempty_box(text)
    elapsed = time.perf_counter() - t
    if name in EXPECTED:
        assert got == EXPECTED[name]
    assert gate == GATE[name]
    assert elapsed < 2.0, f"{name}: {elapsed:.2f} s for 1 MB (target 0.2 s)"


def test_format_gate_on_a_hostile_math_response_is_fast():
    task = parse_task({"kind": "math", "answer": "3"})
    response = "<think>" + "x" * 100 + "</think>" + "The answer is \\boxed{" * 50000 + " \\boxed{3}"
    t = time.perf_counter()
    assert check_format(task, response).ok
    assert extract_answer(response) == "3"  # the unclosed boxes are skipped, the last one counts
    assert time.perf_counter() - t < 2.0
