"""Adversarial math grading: hedges and reward hacks that must grade wrong, equivalent spellings
that must grade right, and hostile inputs on the new paths that must stay inside the time limit.

Expectations are reasoned out by hand (each case says why) or computed independently: Python
integers and fractions.Fraction for numbers, SymPy evaluated at explicit points for functions."""
from __future__ import annotations

import random
import time
from fractions import Fraction

import pytest
import sympy

from megatron_rl.reward.math import check_response, equal_in_process, extract_answer, math_equal
from megatron_rl.reward.math.extract import final_answers


# ---- several boxes offered together are one answer listing them (never just the last) ----------

@pytest.mark.parametrize("response, reference, expected", [
    (r"\boxed{1} or \boxed{2}", "2", False),  # a hedge: either value, no commitment
    (r"\boxed{1} or \boxed{2}", "1", False),
    (r"$\boxed{1}$ or $\boxed{2}$", "2", False),
    (r"\boxed{1} \text{ or } \boxed{2}", "2", False),
    (r"\boxed{1}\boxed{2}", "2", False),
    ("\\boxed{1}\n\\boxed{2}", "2", False),
    (r"The answer is \boxed{1} or maybe \boxed{2}", "2", False),
    (r"\boxed{1}, \boxed{2}, \boxed{3}, \boxed{4}, \boxed{5}", "3", False),
    (r"$\boxed{A}$, $\boxed{B}$, $\boxed{C}$, $\boxed{D}$", "D", False),  # every choice boxed
    (r"\boxed{1} or \boxed{2}", "1, 2", True),  # "1 or 2" lists both, as \boxed{1 \text{ or } 2} does
    (r"The roots are $\boxed{2}$ and $\boxed{3}$.", "2, 3", True),
    (r"\boxed{x=1}, \boxed{y=2}", "(1, 2)", True),  # an answer split over boxes is graded whole
    (r"\boxed{7} or \boxed{7}", "7", True),  # a repeat is one value
    ("So it is \\boxed{1}.\n\nWait, that is wrong: the answer is \\boxed{2}.", "2", True),  # moved on
    ("Part (a): \\boxed{1}. Part (b): \\boxed{2}.", "2", True),
    # the reference echoed in a restatement, then a different final answer: the final one counts
    ("We must show the total is \\boxed{42} as the problem claims.\n\nHowever, the total is \\boxed{7}.",
     "42", False),
    (r"\boxed{}", "5", False),
    (r"\boxed{\text{}}", "5", False),
])
def test_boxes_offered_together_are_one_answer(response, reference, expected):
    assert check_response(response, reference).equal is expected


def test_final_answers_and_the_last_box_contract():
    assert final_answers(r"\boxed{1} or \boxed{2}") == ["1", "2"]
    assert final_answers(r"\boxed{1}. Then \boxed{\boxed{2}}") == ["2"]
    assert final_answers("no box") is None
    assert extract_answer(r"\boxed{1} or \boxed{2}") == "2"  # extract_answer stays the last box


def test_joined_boxes_scan_is_linear():
    hedge = "".join(rf"\boxed{{{i}}} or " for i in range(50_000))  # ~0.9 MB, every box joined
    t = time.monotonic()
    assert final_answers(hedge)[-1] == "49999"
    assert time.monotonic() - t < 3.0  # ~0.3 s here; loose for a loaded machine
    res = check_response(hedge, "49999", timeout=2.0)
    assert not res.equal


# ---- several choices are not one choice ---------------------------------------------------------

@pytest.mark.parametrize("prediction, expected", [
    ("(B) or (C)", False), ("(B) and (C)", False), ("(B) (C)", False), ("(A) (B) (C) (D)", False),
    ("(B), (C)", False), ("(B) or C", False), ("(B) C", False), (r"(B)\text{ or }(C)", False),
    ("(B)", True), ("(B) 5", True), ("(B) x = 3", True), (r"(B) \frac{1}{2}", True),
    (r"\text{(B) all of the above}", True), (r"(B) \frac{x^3}{3} + C", True),
])
def test_choice_hedges(prediction, expected):
    assert equal_in_process(prediction, "B") is expected


# ---- an equation whose constant sides disagree states no value; spaced numbers state none ------

@pytest.mark.parametrize("prediction, reference, expected", [
    ("3 = 4", "4", False), ("3 = 4", "3", False),  # false as written: no value stated
    ("x = 4 = 3", "3", False), ("x = 4 = 3", "4", False), ("x = 3 = 4", "4", False),
    (r"x = 2 \cdot 3 = 6", "6", True),  # 2 * 3 = 6: a worked chain
    ("2 + 2 = 4", "4", True), ("f(2) = 5", "5", True), ("x = y = 3", "3", True),
    ("x = 4 = 3", "x = 3", False),
    ("1 = x^2 + y^2", "x^2 + y^2 = 1", True), ("0 = x^2 - 1", "x^2 - 1 = 0", True),  # equations in x, y
    # numbers side by side are no sum (LaTeX's parser reads "3 4" as 3 + 4)
    ("3 4", "7", False), ("1 2 3 4", "10", False), ("12 34", "46", False), ("3 4", "3 4", True),
])
def test_contradictory_equations(prediction, reference, expected):
    assert equal_in_process(prediction, reference) is expected


def test_generated_chains_against_python_integers():
    rng = random.Random(3)
    for _ in range(10):
        a, b = rng.randint(-99, 99), rng.randint(1, 99)
        total = a + b  # the independent value
        assert equal_in_process(f"x = {a} + {b} = {total}", str(total))
        assert not equal_in_process(f"x = {a} + {b} = {total + 1}", str(total + 1))


# ---- equal only where the variable is positive is not equal -------------------------------------

X, Y = sympy.symbols("x y")


@pytest.mark.parametrize("prediction, reference, pair, expected", [
    ("|x|", "x", (sympy.Abs(X), X), False),
    (r"\sqrt{x^2}", "x", (sympy.sqrt(X**2), X), False),
    (r"\max(x, 0)", "x", (sympy.Max(X, 0), X), False),
    (r"\frac{|x|}{x}", "1", (sympy.Abs(X) / X, sympy.Integer(1)), False),
    ("|a|+|b|", "a+b", None, False),
    (r"\sqrt{x^2}", "|x|", (sympy.sqrt(X**2), sympy.Abs(X)), True),
    (r"\frac{x^2}{|x|}", "|x|", (X**2 / sympy.Abs(X), sympy.Abs(X)), True),
    ("|2x|", "2|x|", (sympy.Abs(2 * X), 2 * sympy.Abs(X)), True),
    # equal wherever both sides are real (sqrt(x) is not real for x < 0)
    (r"\sqrt{x}\sqrt{y}", r"\sqrt{xy}", None, True),
    (r"e^{\ln x}", "x", None, True),
])
def test_identities_of_positive_numbers_only(prediction, reference, pair, expected):
    if pair is not None:  # the independent reference: SymPy at x = -2, -1/2 and 3
        values = [(pair[0] - pair[1]).subs(X, v) for v in (-2, sympy.Rational(-1, 2), 3)]
        assert all(v == 0 for v in values) is expected
    assert equal_in_process(prediction, reference) is expected


# ---- spellings that are the same value --------------------------------------------------------

@pytest.mark.parametrize("prediction, reference", [
    ("\uff08B\uff09", "B"),  # fullwidth parentheses
    ("\uff13\uff0e\uff15", "3.5"),  # fullwidth digits and full stop
    ("\uff0d5", "-5"), ("\u20105", "-5"), ("\u20125", "-5"), ("\ufe635", "-5"), ("\u22125", "-5"),
    ("\u00bd", r"\frac{1}{2}"), ("1\u00bd", "1.5"), ("\u2153", r"\frac{1}{3}"),  # vulgar fractions
    ("x\u00b2+1", "x^2+1"), ("2\u207b\u00b9", "0.5"), ("3\u00d710\u2075", "300000"),  # superscripts
    (r"\frac\pi2", r"\frac{\pi}{2}"), ("\u03c0/2", r"\frac\pi2"),
    ("3*10^-2", "0.03"), ("x^-2", r"\frac{1}{x^2}"),
    ("Infinity", r"\infty"), ("INF", r"\infty"), ("-Infinity", r"-\infty"),
    ("The answer is 5", "5"), ("Answer: 5", "5"), (r"\text{The final answer is } \frac{1}{2}", "0.5"),
    ("La respuesta es 5", "5"), ("La r\u00e9ponse est 5", "5"), ("Die Antwort ist 5", "5"),
    ("\u7b54\u6848\u662f5", "5"), ("\u041e\u0442\u0432\u0435\u0442: 5", "5"), ("The answer is (B)", "B"),
    (r"x<-1 \text{ or } x>3", r"(-\infty,-1)\cup(3,\infty)"), (r"x<-1 \lor x>3", r"(3,\infty)\cup(-\infty,-1)"),
])
def test_equivalent_spellings(prediction, reference):
    assert equal_in_process(prediction, reference)


@pytest.mark.parametrize("prediction, reference", [
    ("Infinity", r"-\infty"), ("The answer is 6", "5"), ("The answer is not 5", "5"),
    ("The answer is 5 or 6", "5"), (r"x \le -1 \text{ or } x>3", r"(-\infty,-1)\cup(3,\infty)"),
    (r"x<-1 \text{ or } x>3", "x<-1"), ("x\u00b2", "2x"),
])
def test_near_spellings_of_other_values(prediction, reference):
    assert not equal_in_process(prediction, reference)


# ---- thousands separators and the decimal comma -----------------------------------------------

@pytest.mark.parametrize("prediction, reference, expected", [
    ("1,000", "1000", True), ("1{,}000", "1000", True), ("1,000", "1", False),
    ("0,125", "125", False),  # a group starting with 0 is no thousands group
    ("0{,}125", "125", False), ("0 125", "125", False),
    ("0,125", "0.125", True), ("3,5", "3.5", True), ("-3,5", "-3.5", True), ("3{,}5", "3.5", True),
    ("3,5", "35", False),
    ("3,5", "3, 5", True), ("3,5", r"\{3, 5\}", True),  # a list reference keeps the list reading
    ("3, 5", "3.5", False),
])
def test_thousands_and_decimal_commas(prediction, reference, expected):
    assert equal_in_process(prediction, reference) is expected


def test_generated_decimal_commas_against_fractions():
    rng = random.Random(8)
    for _ in range(20):
        whole, digits = rng.randint(0, 999), rng.choice([1, 2, 4])
        frac = f"{rng.randint(0, 10**digits - 1):0{digits}d}"
        value = Fraction(int(whole * 10**digits + int(frac)), 10**digits)  # the independent value
        ref = f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
        assert equal_in_process(f"{whole},{frac}", ref), (whole, frac)
        other = value + Fraction(1, 10**digits)
        assert not equal_in_process(f"{whole},{frac}", f"\\frac{{{other.numerator}}}{{{other.denominator}}}")


# ---- hostile inputs on the new paths: wrong, and inside the limit ------------------------------

@pytest.mark.parametrize("response, reference", [
    (r"\boxed{x = " + " = ".join([r"\sqrt{2}"] * 300) + "}", "2"),
    (r"\boxed{" + "+".join(f"|x-{i}|" for i in range(300)) + "}", "x"),
    (r"\boxed{" + "x<1 or " * 2000 + "x>2}", "x>2"),
    (r"\boxed{Answer: " + "a " * 20_000 + "}", "5"),
    ("\\boxed{" + "\u00bd" * 20_000 + "}", "1"),
    (r"\boxed{1} \boxed{10^{10^{10}}}", "1"),
    (r"\boxed{NaN} or \boxed{\infty}", "5"),
])
def test_hostile_inputs_on_new_paths(response, reference):
    timeout = 1.5
    t = time.monotonic()
    assert not check_response(response, reference, timeout=timeout).equal
    assert time.monotonic() - t < timeout + 3.0  # the limit, plus fork/kill/IPC slack
    assert math_equal("2", "2.0", timeout=timeout)  # the pool still serves
