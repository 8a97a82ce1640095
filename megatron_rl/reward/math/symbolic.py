"""Scalar comparison with SymPy: LaTeX -> SymPy (latex2sympy2_extended), then exact checks. Runs
only inside the time-limited workers (math.pool): parsing or simplifying hostile input
(``10^{10^{10}}``, ``(10^9)!``) may take unbounded time here.

Exactness (the policy is documented in the package __init__):
- a decimal literal is the exact rational its digits spell (``0.75\\pi`` = ``3\\pi/4``): the parser's
  Floats are replaced by Rationals before anything is compared, so no float rounding enters;
- two constants are equal when their difference is exactly zero: SymPy's exact arithmetic (big
  integers such as ``2^{64}-1``, ``100!``, ``\\binom{100}{50}`` stay integers), then ``simplify``
  and ``equals``. A 30-digit evaluation only ever *separates* values (a relative gap above 1e-20
  is real at that precision); it never makes two values equal. A difference SymPy can neither
  prove zero nor separate is zero only if it is below 1e-100 (relative) at 120 digits;
- expressions with symbols: exact comparison at random rational points, then ``simplify``;
- the one tolerance: a decimal *reference* with >= 4 significant digits matches a value that
  rounds or truncates to it (math.parse.rounds_to): ``\\pi`` answers ``3.1416``, but
  ``3.1416`` does not answer ``\\pi``.
"""
from __future__ import annotations

import dataclasses
import random
from fractions import Fraction
from functools import lru_cache

import sympy
from latex2sympy2_extended import latex2sympy
from latex2sympy2_extended.math_normalization import NormalizationConfig

from megatron_rl.reward.math.parse import Scalar, rounds_to

_NO_NORMALISATION = NormalizationConfig(basic_latex=False, units=False, malformed_operators=False,
                                        nits=False, boxed="none", equations=False)
_PREC = 30  # digits of the evaluation that separates values
_SEPARATED = sympy.Float("1e-20", _PREC)  # a relative gap this large at _PREC digits is real
_ZERO_DIGITS, _ZERO_BELOW = 120, sympy.Float("1e-100", 5)  # last resort for an unprovable difference
_HUGE = sympy.Float("1e1000", 5)  # beyond this, do not expand values exactly (10^{10^{10}})
_N_POINTS = 5
_MAX_SIGNED_OPS = 400  # operations in both sides beyond which the signed points are not tried
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
    if isinstance(expr, sympy.Basic):
        floats = expr.atoms(sympy.Float)
        if floats:  # a Float here is a decimal literal (the parse is unevaluated): its exact value
            expr = expr.xreplace({f: sympy.Rational(str(f)) for f in floats})
    return expr


def warm_up() -> None:
    """Build the parser's tables now, so that forked workers start with them."""
    sympy.N(to_sympy("\\frac{1}{2}+x").subs("x", 1))


def scalar_expr(x: Scalar) -> sympy.Basic:
    if x.number is not None:
        return sympy.Rational(x.number.numerator, x.number.denominator)
    return to_sympy(x.source)


def _numeric(expr: sympy.Basic, digits: int = _PREC) -> sympy.Basic | None:
    try:
        v = sympy.N(expr, digits)
    except Exception:  # SymPy fails in many ways on a hostile answer (in a time-limited worker): no number
        return None
    return v if v.is_number else None


def _finite(v: sympy.Basic) -> bool:
    return v.is_finite is True or (v.is_number and v.is_finite is not False and not v.has(sympy.zoo, sympy.oo, sympy.nan))


def _approx_fraction(expr: sympy.Basic, decimals: int) -> Fraction | None:
    """A rational within 1e-30 (relative) of a real ``expr``, precise past ``decimals`` places."""
    v = _numeric(expr)
    if v is None or not v.is_real or not _finite(v):
        return None
    magnitude = 0 if v == 0 else max(0, int(sympy.log(abs(v), 10).evalf(5)) + 1)
    if magnitude > 10_000:
        return None  # no decimal reference (<= 4000 digits, exponent <= 4000) is that large
    v = _numeric(expr, max(_PREC, decimals + magnitude + 30))
    try:
        return None if v is None else Fraction(str(v))
    except ValueError:  # a printed form Fraction does not read: no rounding verdict
        return None


def compare_constants(ex: sympy.Basic, ey: sympy.Basic) -> bool | None:
    """Exact verdict on two constants where a cheap one exists: True / False, None: undecided
    (numerically indistinguishable at _PREC digits, not yet proven equal), or not finite."""
    diff = ex - ey
    if diff == 0:
        return True
    if diff.is_Rational:
        return False  # an exact non-zero difference: 2^{64}-1 vs 2^{64}
    vx, vy = _numeric(ex), _numeric(ey)
    if vx is None or vy is None or not (_finite(vx) and _finite(vy)):
        return None
    scale = max(abs(vx), abs(vy))
    if abs(vx - vy) > _SEPARATED * scale:
        return False  # a gap the 30-digit evaluation cannot have made up
    if scale < _HUGE:  # expand unevaluated parts (factorials, powers) into exact numbers
        try:
            diff = ex.doit() - ey.doit()
        except Exception:
            return None
        if diff == 0:
            return True
        if diff.is_Rational:
            return False
    return None


def _proven_zero(diff: sympy.Basic) -> bool | None:
    """simplify, then equals: True / False when SymPy can tell, else None."""
    try:
        if sympy.simplify(diff) == 0:
            return True
    except Exception:
        pass
    try:
        verdict = diff.equals(0)
    except Exception:
        return None
    return None if verdict is None else bool(verdict)


def _negligible(diff: sympy.Basic, scale: sympy.Basic) -> bool:
    v = _numeric(diff, _ZERO_DIGITS)
    return v is not None and _finite(v) and bool(abs(v) <= _ZERO_BELOW * max(abs(scale), 1))


def constants_equal(x: Scalar, ex: sympy.Basic, y: Scalar, ey: sympy.Basic) -> bool:
    """Equality of two expressions without free symbols (x is the prediction, y the reference)."""
    if y.decimals is not None and y.number is not None:  # a decimal reference may be a rounded value
        approx = _approx_fraction(ex, y.decimals)
        if approx is not None and rounds_to(approx, y):
            return True
    verdict = compare_constants(ex, ey)
    if verdict is not None:
        return verdict
    vx, vy = _numeric(ex), _numeric(ey)
    if vx is None or vy is None:
        return False
    if not (_finite(vx) and _finite(vy)):
        return vx == vy and not vx.has(sympy.nan)  # oo = oo, -oo != oo
    diff = ex - ey
    proven = _proven_zero(diff)
    return proven if proven is not None else _negligible(diff, vx)


def _random_points(symbols, seed: str, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        yield {s: sympy.Rational(rng.randint(1, 10**6), 10**6) * 2 + sympy.Rational(1, 7) for s in symbols}


def _signed_points(symbols, seed: str, n: int):
    """Points where each symbol's sign is random (the positive points miss |x| != x)."""
    rng = random.Random(seed)
    for point in _random_points(symbols, seed, n):
        yield {s: v if rng.random() < 0.5 else -v for s, v in point.items()}


def _real_at(expr: sympy.Basic, point: dict) -> bool:
    """Whether every root, power and function inside ``expr`` is real at ``point``: the point lies
    in the expression's real domain (sqrt(x) at x < 0 does not, |x| does)."""
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Function) or (isinstance(node, sympy.Pow) and not node.exp.is_integer):
            if node.xreplace(point).is_extended_real is not True:
                return False
    return True


def _differ_off_positive(ex: sympy.Basic, ey: sympy.Basic, symbols) -> bool:
    """Whether the two sides differ at a point with negative coordinates where both are real.

    The exact points are all positive, where |x| = x, sqrt(x^2) = x and max(x, 0) = x; an answer
    equal to the reference only there is another function. Points outside either side's real
    domain are skipped, so identities that hold wherever both sides are real stay equal
    (sqrt(x) sqrt(y) = sqrt(xy), log(x^2) = 2 log(x))."""
    if sympy.count_ops(ex) + sympy.count_ops(ey) > _MAX_SIGNED_OPS:
        return False  # too big to walk node by node inside the limit: the positive points decide
    for point in _signed_points(symbols, f"{ex}|{ey}|signed", _N_POINTS):
        if not (_real_at(ex, point) and _real_at(ey, point)):
            continue
        if compare_constants(ex.subs(point), ey.subs(point)) is False:
            return True
    return False


def functions_equal(ex: sympy.Basic, ey: sympy.Basic) -> bool:
    """Equality of expressions with free symbols: exact values at random rational points (a
    non-zero rational function vanishes at 5 random points with negligible probability), then
    simplify; points SymPy cannot decide exactly must agree to 1e-100 at 120 digits. Points of
    both signs must agree too where both sides are real (|x| is not x)."""
    symbols = sorted(ex.free_symbols | ey.free_symbols, key=str)
    undecided = []
    for point in _random_points(symbols, f"{ex}|{ey}", _N_POINTS):
        vx, vy = ex.subs(point), ey.subs(point)
        verdict = compare_constants(vx, vy)
        if verdict is False:
            return False
        if verdict is None:
            undecided.append((vx, vy))
    if _differ_off_positive(ex, ey, symbols):
        return False
    if not undecided:
        return True
    proven = _proven_zero(ex - ey)
    if proven is not None:
        return proven
    finite = [(vx, vy) for vx, vy in undecided if (v := _numeric(vx)) is not None and _finite(v)]
    return len(finite) >= 3 and all(_negligible(vx - vy, _numeric(vx)) for vx, vy in finite)


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
    return functions_equal(ex, ey)


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
