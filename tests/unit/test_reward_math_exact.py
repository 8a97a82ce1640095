"""Exact math: exact values compare exactly, the decimal rules, redundant braces, the math-verify
backend, and grading (scan included) inside the math time limit.

Expectations come from independent references: Python integers (math.factorial, math.comb, 2**n),
fractions.Fraction, and decimals printed by Python's float formatting of math.pi / math.sqrt."""
from __future__ import annotations

import math
import random
import time
from fractions import Fraction

import pytest

from megatron_rl.config import RewardConfig
from megatron_rl.reward import math as rmath
from megatron_rl.reward import score
from megatron_rl.reward.math import check, check_response, equal_in_process, extract_answer, math_equal


def test_issue_cases_through_the_pool():
    assert not math_equal("2^{64}-1", "2^{64}")
    assert not math_equal("100!+1", "100!")
    assert not math_equal(r"\binom{100}{50}+1", r"\binom{100}{50}")
    assert not math_equal("3.14159", r"\pi") and not math_equal("1.414", r"\sqrt{2}")
    assert math_equal("{{42}}", "42") and math_equal(r"{\frac{1}{2}}", r"\frac{1}{2}")


@pytest.mark.parametrize("n", [53, 64, 65, 100, 127, 300])
def test_powers_of_two_are_exact(n):
    exact = 2**n  # an independent big integer
    assert equal_in_process(f"2^{{{n}}}", str(exact))
    assert equal_in_process(f"2^{{{n}}}-1", str(exact - 1))
    assert not equal_in_process(f"2^{{{n}}}-1", f"2^{{{n}}}")
    assert not equal_in_process(str(exact + 1), f"2^{{{n}}}")
    assert not equal_in_process(f"2^{{{n}}}x+1", f"{exact}x")  # exact inside expressions too


def test_factorials_and_binomials_against_python_integers():
    rng = random.Random(5)
    for _ in range(6):
        n = rng.randint(20, 120)
        k = rng.randint(1, n - 1)
        fact, comb = math.factorial(n), math.comb(n, k)
        assert equal_in_process(f"{n}!", str(fact))
        assert not equal_in_process(f"{n}!", str(fact + 1))
        assert not equal_in_process(f"{n}!+1", f"{n}!")
        assert equal_in_process(rf"\binom{{{n}}}{{{k}}}", str(comb))
        assert not equal_in_process(rf"\binom{{{n}}}{{{k}}}", str(comb - 1))
        assert equal_in_process(rf"\frac{{{n}!}}{{{k}!\,({n}-{k})!}}", str(comb))


def test_rationals_are_exact():
    rng = random.Random(11)
    for _ in range(40):
        p, q = rng.randint(-10**25, 10**25), rng.randint(1, 10**20)
        a = Fraction(p, q)
        b = a + Fraction(1, 10**30) if rng.random() < 0.5 else a
        ref = rf"\frac{{{b.numerator}}}{{{b.denominator}}}"
        assert equal_in_process(rf"\frac{{{p}}}{{{q}}}", ref) is (a == b)


@pytest.mark.parametrize("q", [Fraction(1, 2), Fraction(3, 8), Fraction(-5, 4), Fraction(7, 3), Fraction(1, 3),
                               Fraction(2, 7)])
@pytest.mark.parametrize("places", [1, 3, 6])
def test_decimal_prediction_vs_exact_rational(q, places):
    """A decimal prediction is the exact value its digits spell: equal iff Fraction says so."""
    dec = f"{float(q):.{places}f}"
    frac = rf"\frac{{{q.numerator}}}{{{q.denominator}}}"
    assert equal_in_process(dec, frac) is (Fraction(dec) == q)
    assert equal_in_process(f"{dec}x", rf"{frac}x") is (Fraction(dec) == q)


@pytest.mark.parametrize("latex, value", [(r"\pi", math.pi), (r"\sqrt{2}", math.sqrt(2)), (r"e", math.e),
                                          (r"\frac{\sqrt{3}}{2}", math.sqrt(3) / 2), (r"\ln 2", math.log(2))])
def test_decimal_vs_irrational(latex, value):
    for places in (2, 4, 5, 8):
        dec = f"{value:.{places}f}"
        # a rounded decimal never equals an irrational exact reference
        assert not equal_in_process(dec, latex), (dec, latex)
        # an exact prediction answers a decimal reference it rounds to (>= 4 significant digits)
        sig = len(dec.replace(".", "").lstrip("0"))
        assert equal_in_process(latex, dec) is (sig >= 4), (latex, dec)
    finer, coarser = f"{value:.7f}", f"{value:.4f}"
    assert equal_in_process(finer, coarser)  # a finer decimal rounds to the reference
    assert not equal_in_process(coarser, finer)  # a coarser one does not
    assert not equal_in_process(f"{value + 2e-4:.7f}", coarser)  # neither rounds nor truncates to it


def test_decimal_reference_truncation_and_short_decimals():
    assert equal_in_process(r"\frac{2}{3}", "0.6666") and equal_in_process(r"\frac{2}{3}", "0.6667")
    assert not equal_in_process(r"\frac{2}{3}", "0.6668")
    assert not equal_in_process("0.333", r"\frac{1}{3}")  # documented: the reference is exact
    assert not equal_in_process(r"\frac{1}{3}", "0.33")  # short decimals are exact values
    assert not equal_in_process("0.125", "0.13") and equal_in_process("0.125", r"\frac{1}{8}")
    assert equal_in_process("6.02214\\times 10^{23}", "6.022\\times10^{23}")  # scientific references round
    assert not equal_in_process("6.022\\times 10^{23}", "6.02214\\times10^{23}")
    assert equal_in_process("1e3", "1000") and equal_in_process("1.5e-3", r"\frac{3}{2000}")


def test_exact_symbolic_forms():
    assert equal_in_process(r"\sqrt{2}+\sqrt{3}", r"\sqrt{5+2\sqrt{6}}")
    assert equal_in_process(r"\sin\frac{\pi}{12}", r"\frac{\sqrt{6}-\sqrt{2}}{4}")
    assert equal_in_process(r"(x+1)^{2}", "x^2+2x+1") and equal_in_process(r"0.75\pi", r"\frac{3\pi}{4}")
    assert not equal_in_process(r"10^{30}+1", r"10^{30}") and not equal_in_process(r"10^{-30}", "0")
    assert not equal_in_process(r"x^{2}+10^{-30}", "x^2")


@pytest.mark.parametrize("pred, ref, equal", [
    ("{42}", "42", True), ("{{x+1}}", "x+1", True), ("{ {7} }", "7", True), (r"{\frac{1}{2}}", "0.5", True),
    (r"\{1,2\}", r"\{2,1\}", True), (r"\{1,2\}", "1", False), (r"{\frac{a}{b}}", r"\frac{b}{a}", False),
    (r"(\{1\}, {2})", r"(\{1\}, 2)", True), ("{1}{2}", "12", False),
])
def test_redundant_braces(pred, ref, equal):
    assert equal_in_process(pred, ref) is equal


def test_check_response_extracts_in_the_worker():
    res = check_response(r"so \boxed{1} and finally \boxed{\frac{2}{4}}", "0.5")
    assert res.equal and res.prediction == r"\frac{2}{4}" and res.status == "ok"
    none = check_response("no box", "1")
    assert not none.equal and none.status == "no_answer" and none.prediction is None
    hostile = "The answer is \\boxed{" * 50000 + r"\boxed{3}"
    assert check_response(hostile, "3", timeout=2.0).equal
    with pytest.raises(ValueError, match="math backend"):
        check_response("x", "1", backend="wolfram")


def test_the_scan_counts_against_the_time_limit(monkeypatch):
    """A scan that would hang is killed with the comparison: it runs inside the worker."""
    def slow_scan(text):
        time.sleep(30)

    monkeypatch.setattr(rmath, "final_answer", slow_scan)
    monkeypatch.setattr(rmath, "_pools", {})  # fresh workers, forked with the slow scan
    try:
        t = time.monotonic()
        res = check_response(r"\boxed{1}", "1", timeout=0.5)
        assert res.status == "timeout" and not res.equal
        assert time.monotonic() - t < 5.0
    finally:
        rmath.close_pool()


MATH_TASK = {"kind": "math", "problem": "What is ten cubed?", "answer": "1000"}
RESPONSE = "<think>Ten cubed is a thousand.</think> The answer is $\\boxed{1e3}$."


def test_backends_disagree_where_math_verify_misses_scientific_notation():
    assert check("1e3", "1000").equal
    mv = check("1e3", "1000", backend="math_verify")
    assert mv.status == "ok" and not mv.equal  # math-verify reads 1e3 as 1*E*3
    assert check("2", "2.0", backend="math_verify").equal
    # extraction is ours with either backend: the LAST box, not math-verify's set of all boxes ...
    assert check_response(r"\boxed{1}. Wait, it is \boxed{2}", "2", backend="math_verify").equal
    # ... and boxes offered together are one answer listing them, a hedge that matches no single value
    for backend in ("sympy", "math_verify"):
        assert not check_response(r"\boxed{1} or \boxed{2}", "2", backend=backend).equal


def test_reward_config_backend_reaches_the_grader():
    cfg = RewardConfig(language_check=False)
    by_sympy = score(MATH_TASK, RESPONSE, cfg, num_tokens=20)
    by_mv = score(MATH_TASK, RESPONSE, RewardConfig(language_check=False, math_backend="math_verify"),
                  num_tokens=20)
    assert by_sympy.correct and not by_mv.correct
    assert by_sympy.details["prediction"] == by_mv.details["prediction"] == "1e3"


def test_verifier_pool_passes_the_backend_to_its_workers():
    from megatron_rl.reward.pool import VerifierPool

    items = [(MATH_TASK, RESPONSE, 20)]
    for backend, correct in (("sympy", True), ("math_verify", False)):
        cfg = RewardConfig(language_check=False, math_backend=backend)
        with VerifierPool(cfg, workers=1) as pool:
            (res,) = pool.map(items)
        assert res.correct is correct, backend


def test_extract_answer_contract_unchanged():
    assert extract_answer(r"\boxed{1} then \boxed{\boxed{ 2 }}") == "2"
    assert extract_answer(r"\boxed{5") is None
