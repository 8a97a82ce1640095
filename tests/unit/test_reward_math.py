"""megatron_rl.reward.math: extraction, the labelled equivalence set, generated pairs checked
against SymPy-built references, hostile inputs under the time limit."""
from __future__ import annotations

import json
import random
import time
from fractions import Fraction
from pathlib import Path

import pytest
import sympy

from megatron_rl.reward.math import check, equal_in_process, extract_answer, math_equal

DATA = Path(__file__).resolve().parents[1] / "data" / "math_equivalence.jsonl"
ROWS = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("response, expected", [
    (r"so \boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\{1, \{2\}\}}", r"\{1, \{2\}\}"),
    (r"\boxed{\frac{a}{\sqrt{b^{2}}}}.", r"\frac{a}{\sqrt{b^{2}}}"),
    (r"\boxed {x^{2}}", "x^{2}"),
    (r"answer: \fbox{3}", "3"),
    (r"$\boxed 5$.", "5"),
    (r"\boxed 42.", "42"),
    (r"\boxed{\boxed{7}}", "7"),
    (r"\boxed{}", ""),
    (r"\boxed{5", None),
    (r"\boxedfoo{5}", None),
    ("no box here", None),
    (r"\boxed{1} and a truncated \boxed{2", "1"),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_extract_answer_rejects_non_str():
    with pytest.raises(TypeError):
        extract_answer(None)


def test_labelled_set_is_large_and_covers_every_category():
    cats = {r["category"] for r in ROWS}
    assert len(ROWS) >= 250
    for needed in ("integer", "fraction_decimal", "radical", "pi", "expression", "equation", "set",
                   "tuple", "interval", "percent", "unit", "degree", "text", "choice", "matrix",
                   "scientific", "pm", "infinity", "hard_negative", "hostile"):
        assert needed in cats
    assert sum(not r["expected"] for r in ROWS) >= 80  # plenty of negatives


def test_labelled_set_in_process():
    """Every non-hostile labelled pair, decided by the comparison itself (no pool)."""
    wrong = [(r["prediction"], r["reference"], r["expected"]) for r in ROWS
             if r["category"] != "hostile"
             and equal_in_process(r["prediction"], r["reference"]) != r["expected"]]
    assert wrong == []


@pytest.mark.parametrize("row", [r for r in ROWS if r["category"] == "hostile"],
                         ids=lambda r: r["prediction"][:20])
def test_hostile_inputs_return_within_the_limit(row):
    timeout = 1.5
    t = time.monotonic()
    assert math_equal(row["prediction"], row["reference"], timeout=timeout) is row["expected"]
    assert time.monotonic() - t < timeout + 3.0  # the limit, plus fork/kill/IPC slack
    assert math_equal("2", "2.0", timeout=timeout)  # the pool still serves after a kill


def test_generated_rational_pairs():
    """Random rationals against decimals/fractions rendered independently with Fraction."""
    rng = random.Random(0)
    for _ in range(40):
        q = Fraction(rng.randint(-999, 999), rng.choice([1, 2, 4, 5, 8, 10, 20, 25, 3, 7, 9, 11]))
        frac = rf"\frac{{{q.numerator}}}{{{q.denominator}}}" if q.denominator != 1 else str(q.numerator)
        assert equal_in_process(frac, f"{q.numerator}/{q.denominator}")
        if q.denominator in (1, 2, 4, 5, 8, 10, 20, 25):
            dec = f"{float(q):.3f}"
            assert equal_in_process(dec, frac), (dec, frac)
            assert not equal_in_process(f"{float(q) + 0.01:.3f}", frac)
        n = rng.randint(1000, 10**9)
        assert equal_in_process(f"{n:,}", str(n))
        assert not equal_in_process(f"{n:,}", str(n + 1))


def test_generated_polynomials_against_sympy():
    """Expanded vs factored forms printed by sympy.latex; perturbed forms must differ."""
    x, y = sympy.symbols("x y")
    rng = random.Random(1)
    for _ in range(8):
        a, b, c = (rng.randint(-5, 5) or 1 for _ in range(3))
        expr = (a * x + b) * (x - c) * (y + a)
        assert equal_in_process(sympy.latex(sympy.expand(expr)), sympy.latex(expr))
        assert not equal_in_process(sympy.latex(sympy.expand(expr) + 1), sympy.latex(expr))


def test_math_equal_through_the_pool():
    assert math_equal(r"\frac{1}{2}", "0.5")
    assert not math_equal("0.5", "0.05")
    res = check(r"2\sqrt{2}", r"\sqrt{8}", timeout=5)
    assert res.equal and res.status == "ok"
    assert check("5 cm", "5").status == "identical"


def test_math_equal_rejects_bad_arguments():
    with pytest.raises(TypeError):
        math_equal(1, "1")
    with pytest.raises(ValueError):
        math_equal("1", "1", timeout=0)
