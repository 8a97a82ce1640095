"""Scalar comparison with SymPy: LaTeX -> SymPy (latex2sympy2_extended), then exact, numeric and
symbolic checks. Runs only inside the time-limited workers (math_pool): parsing or simplifying
hostile input (``10^{10^{10}}``, ``(10^9)!``) may take unbounded time here.

Numeric policy (documented in math.py): exact values must agree to ~1e-10 relative; a decimal
literal with >= 4 significant digits also matches an exact non-terminating value it rounds or
truncates to (0.3333 ~ 1/3, 1.414 ~ sqrt 2, 3.142 ~ pi; but 3.14 != pi, 0.33 != 1/3).
"""
from __future__ import annotations

import dataclasses
import random
from fractions import Fraction
from functools import lru_cache

import sympy
from latex2sympy2_extended import latex2sympy
from latex2sympy2_extended.math_normalization import NormalizationConfig

from megatron_rl.reward.math_parse import Scalar

_NO_NORMALISATION = NormalizationConfig(basic_latex=False, units=False, malformed_operators=False,
                                        nits=False, boxed="none", equations=False)
_PREC = 30
_EXACT_RTOL = sympy.Float("1e-10", _PREC)
_FLOAT_RTOL = sympy.Float("1e-6", _PREC)
_MIN_ROUNDING_SIG = 4
_N_POINTS = 5
_I = sympy.Symbol("i")


class Unparseable(ValueError):
    pass


@lru_cache(maxsize=4096)
def to_sympy(source: str) -> sympy.Basic:
    """SymPy form of a normalised scalar (cached: references repeat across a group of samples)."""
    try:
        expr = latex2sympy(source, normalization_config=_NO_NORMALISATION)
    except Exception as exc:  # the parser raises bare Exception on syntax errors
        raise Unparseable(f"cannot parse {source[:80]!r}: {exc}") from None
    if isinstance(expr, sympy.Basic) and expr.has(sympy.UnevaluatedExpr):  # \gcd, \operatorname{lcm}
        expr = expr.replace(lambda e: isinstance(e, sympy.UnevaluatedExpr), lambda e: e.args[0])
    return expr


def warm_up() -> None:
    """Build the parser's tables now, so that forked workers start with them."""
    sympy.N(to_sympy("\\frac{1}{2}+x").subs("x", 1))


def scalar_expr(x: Scalar) -> sympy.Basic:
    if x.number is not None:
        return sympy.Rational(x.number.numerator, x.number.denominator)
    return to_sympy(x.source)


def _is_inexact(x: Scalar, expr: sympy.Basic) -> bool:
    return x.decimals is not None or bool(expr.atoms(sympy.Float))


def _rounds_to(decimal: Scalar, value: sympy.Basic) -> bool:
    """Whether the decimal literal is ``value`` rounded or truncated to the literal's places."""
    if decimal.sig_digits < _MIN_ROUNDING_SIG or decimal.number is None:
        return False
    if not (value.is_real and value.is_finite):
        return False
    places = decimal.decimals or 0
    digits = _PREC + 10
    v = sympy.N(value, digits)
    scaled = Fraction(str(sympy.N(v * 10**places, digits)))
    target = decimal.number * 10**places
    lo = Fraction(int(scaled // 1))
    return target in (lo, lo + 1) and abs(target - scaled) < 1


def _close(a: sympy.Basic, b: sympy.Basic, rtol: sympy.Float) -> bool:
    diff = abs(a - b)
    scale = max(abs(a), abs(b), sympy.Float(1e-30, _PREC))
    return bool(diff <= rtol * scale) or bool(diff < sympy.Float("1e-25", _PREC))


def _numeric(expr: sympy.Basic) -> sympy.Basic | None:
    try:
        v = sympy.N(expr, _PREC)
    except Exception:
        return None
    return v if v.is_number else None


def _finite(v: sympy.Basic) -> bool:
    return v.is_finite is True or (v.is_number and v.is_finite is not False and not v.has(sympy.zoo, sympy.oo, sympy.nan))


def constants_equal(x: Scalar, ex: sympy.Basic, y: Scalar, ey: sympy.Basic) -> bool:
    """Equality of two expressions without free symbols."""
    vx, vy = _numeric(ex), _numeric(ey)
    if vx is None or vy is None:
        return False
    if not (_finite(vx) and _finite(vy)):
        return vx == vy and not vx.has(sympy.nan)
    x_inexact, y_inexact = _is_inexact(x, ex), _is_inexact(y, ey)
    if x.decimals is not None and not y_inexact and _rounds_to(x, ey):
        return True
    if y.decimals is not None and not x_inexact and _rounds_to(y, ex):
        return True
    rtol = _FLOAT_RTOL if (x_inexact and y_inexact and x.decimals is None and y.decimals is None) else _EXACT_RTOL
    if x_inexact and not y_inexact and x.decimals is None:
        rtol = _FLOAT_RTOL  # a float that came from a computation (1.5 \times 10^{3})
    if y_inexact and not x_inexact and y.decimals is None:
        rtol = _FLOAT_RTOL
    return _close(vx, vy, rtol)


def _random_points(symbols, seed: str, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        yield {s: sympy.Rational(rng.randint(1, 10**6), 10**6) * 2 + sympy.Rational(1, 7) for s in symbols}


def functions_equal(ex: sympy.Basic, ey: sympy.Basic, inexact: bool) -> bool:
    """Equality of expressions with free symbols: random-point evaluation, then simplify."""
    symbols = sorted(ex.free_symbols | ey.free_symbols, key=str)
    rtol = _FLOAT_RTOL if inexact else _EXACT_RTOL
    agreed = 0
    for point in _random_points(symbols, f"{ex}|{ey}", _N_POINTS):
        vx, vy = _numeric(ex.subs(point)), _numeric(ey.subs(point))
        if vx is None or vy is None or not (_finite(vx) and _finite(vy)):
            continue
        if not _close(vx, vy, rtol):
            return False
        agreed += 1
    if agreed >= 3:
        return True
    try:
        return sympy.simplify(ex - ey) == 0
    except Exception:
        return False


def _relational_equal(ex: sympy.Basic, ey: sympy.Basic) -> bool:
    if isinstance(ex, sympy.core.relational.Relational) and isinstance(ey, sympy.core.relational.Relational):
        syms = ex.free_symbols | ey.free_symbols
        if len(syms) == 1:
            try:
                return ex.as_set() == ey.as_set()
            except Exception:
                pass
        return type(ex) is type(ey) and sympy.simplify((ex.lhs - ex.rhs) - (ey.lhs - ey.rhs)) == 0
    return False


def sympy_equal(x: Scalar, y: Scalar, scale_x=1, scale_y=1) -> bool:
    """Whether two scalars are equal (``scale_*`` carry percent / degree conversions)."""
    ex, ey = scalar_expr(x), scalar_expr(y)
    if not (isinstance(ex, sympy.Expr) and isinstance(ey, sympy.Expr)):
        if ex == ey:
            return True
        return _relational_equal(ex, ey)
    ex, ey = ex * scale_x, ey * scale_y
    if ex == ey:
        return True
    free = ex.free_symbols | ey.free_symbols
    if free == {_I}:  # "2+3i": i is the imaginary unit when it is the only letter
        ex, ey = ex.subs(_I, sympy.I), ey.subs(_I, sympy.I)
        free = set()
    if not free:
        # a rescaled literal is no longer the decimal that was written: no rounding rule for it
        if scale_x != 1:
            x = dataclasses.replace(x, decimals=None, sig_digits=0)
        if scale_y != 1:
            y = dataclasses.replace(y, decimals=None, sig_digits=0)
        return constants_equal(x, ex, y, ey)
    return functions_equal(ex, ey, _is_inexact(x, ex) or _is_inexact(y, ey))


def equations_proportional(lhs_a: str, rhs_a: str, lhs_b: str, rhs_b: str) -> bool:
    """Whether lhs_a = rhs_a and lhs_b = rhs_b are the same equation up to a constant factor."""
    da = to_sympy(lhs_a) - to_sympy(rhs_a)
    db = to_sympy(lhs_b) - to_sympy(rhs_b)
    if not (da.free_symbols and db.free_symbols) or da.free_symbols != db.free_symbols:
        return False
    ratio = sympy.simplify(da / db)
    return bool(ratio.is_number) and ratio != 0 and ratio.is_finite is not False


def interval_set(left: str, lo: Scalar, hi: Scalar, right: str) -> sympy.Set:
    """The real interval written with these brackets and endpoints."""
    return sympy.Interval(scalar_expr(lo), scalar_expr(hi), left == "(", right == ")")


def relation_set(x: Scalar) -> sympy.Set | None:
    """The solution set of a one-variable inequality (``x \\ge 3``, ``3 < x < 5``), else None."""
    expr = scalar_expr(x)
    if isinstance(expr, (sympy.core.relational.Relational, sympy.And, sympy.Or)):
        if len(expr.free_symbols) == 1:
            return expr.as_set()
    return None
