"""Equivalence of two parsed answers (math.parse values), recursively by structure.

Policies (why, in short):
- sets and bare comma lists are order-free (multiset matching); bracketed tuples are ordered; a
  2-element bracketed pair is an interval too, so its brackets must match ([1,2) != [1,2]);
- an equation matches a bare value through its right side (``x=3`` ~ ``3``), two equations match
  when their left sides are the same symbol and right sides agree, or when lhs-rhs is proportional;
- a one-element set/list matches its element; a column/row matrix matches a tuple of its entries;
- percent: ``50\\%`` ~ ``50`` ~ ``0.5`` (when only one side has the sign, either reading is accepted);
- degrees: ``30^\\circ`` ~ ``30`` ~ ``\\pi/6`` (same rule: either reading);
- numbers: exact (the package __init__ has the rules); ``parse.rounds_to`` is the one tolerance, for
  decimal references;
- text answers compare case- and space-insensitively; choice letters compare by letter.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_rl.reward.math.normalize import Normalized
from megatron_rl.reward.math.parse import (Choice, Equation, Matrix, Scalar, Seq, Text, Union,
                                           parse_text, rounds_to)


@dataclass(frozen=True)
class Flags:
    percent: bool = False
    degrees: bool = False


def _letter(v) -> str | None:
    if isinstance(v, Choice):
        return v.letter
    if isinstance(v, Scalar) and len(v.source) == 1 and v.source.isalpha():
        return v.source.upper()
    if isinstance(v, Text) and len(v.words) == 1:
        return v.words.upper()
    return None


def _plain_text(v) -> str | None:
    if isinstance(v, Text):
        return v.words
    if isinstance(v, Scalar):
        return "".join(v.source.lower().split())
    return None


def _scales(mine: Flags, other: Flags) -> list:
    """Readings of one side's value: percent/degree signs only one side has give two readings."""
    import sympy

    out = [1]
    if mine.percent and not other.percent:
        out.append(sympy.Rational(1, 100))
    if mine.degrees and not other.degrees:
        out.append(sympy.pi / 180)
    return out


def _fast_numbers(a: Scalar, b: Scalar) -> bool | None:
    """Two rational literals: decided exactly, without SymPy; None when either is not one."""
    if a.number is None or b.number is None:
        return None
    return a.number == b.number or rounds_to(a.number, b)


def scalars_equal(a: Scalar, b: Scalar, fa: Flags, fb: Flags) -> bool:
    from megatron_rl.reward.math.symbolic import Unparseable, sympy_equal  # heavy import: workers only

    scales_a, scales_b = _scales(fa, fb), _scales(fb, fa)
    if len(scales_a) == 1 and len(scales_b) == 1:
        fast = _fast_numbers(a, b)
        if fast is not None:
            return fast
    for sa in scales_a:
        for sb in scales_b:
            try:
                if sympy_equal(a, b, sa, sb):
                    return True
            except Unparseable:
                return _plain_text(a) == _plain_text(b)
            except (TypeError, ValueError, AttributeError, ZeroDivisionError, NotImplementedError):
                continue
    return False


def _multiset_equal(xs: tuple, ys: tuple, fa: Flags, fb: Flags) -> bool:
    if len(xs) != len(ys):
        return False
    unused = list(ys)
    for x in xs:
        for k, y in enumerate(unused):
            if values_equal(x, y, fa, fb):
                del unused[k]
                break
        else:
            return False
    return True


def _ordered_equal(xs: tuple, ys: tuple, fa: Flags, fb: Flags) -> bool:
    return len(xs) == len(ys) and all(values_equal(x, y, fa, fb) for x, y in zip(xs, ys))


def _seq_equal(a: Seq, b: Seq, fa: Flags, fb: Flags) -> bool:
    if a.kind == "ordered" and b.kind == "ordered":
        if len(a.items) == 2 and (a.left, a.right) != (b.left, b.right):
            return False  # intervals: open and closed ends differ
        return _ordered_equal(a.items, b.items, fa, fb)
    if a.kind == "ordered" or b.kind == "ordered":
        # "(1, 2)" vs "1, 2": accepted only in order and only for round brackets (not intervals)
        o, other = (a, b) if a.kind == "ordered" else (b, a)
        if other.kind == "list" and o.left == "(" and o.right == ")":
            return _ordered_equal(a.items, b.items, fa, fb)
        return False
    return _multiset_equal(a.items, b.items, fa, fb)


def _matrix_entries(m: Matrix) -> tuple | None:
    if len(m.rows) == 1:
        return m.rows[0]
    if all(len(r) == 1 for r in m.rows):
        return tuple(r[0] for r in m.rows)
    return None


def _single(v):
    """The element of a one-element set or list, else v."""
    if isinstance(v, Seq) and v.kind != "ordered" and len(v.items) == 1:
        return v.items[0]
    return v


def _equations_equal(a: Equation, b: Equation, fa: Flags, fb: Flags) -> bool:
    if a.lhs == b.lhs and values_equal(a.rhs, b.rhs, fa, fb):
        return True
    if isinstance(a.rhs, Scalar) and isinstance(b.rhs, Scalar):
        from megatron_rl.reward.math.symbolic import Unparseable, equations_proportional

        try:
            return equations_proportional(a.lhs, a.rhs.source, b.lhs, b.rhs.source)
        except (Unparseable, TypeError, ValueError, AttributeError, ZeroDivisionError):
            return False
    return False


def _is_constant(v) -> bool:
    """Whether a parsed side is a number (no variable in it): ``3``, ``2 \\cdot 3``, ``\\sqrt{2}``."""
    if not isinstance(v, Scalar):
        return False
    if v.number is not None:
        return True
    from megatron_rl.reward.math.symbolic import Unparseable, to_sympy

    try:
        expr = to_sympy(v.source)
    except Unparseable:
        return False
    return getattr(expr, "is_number", False) is True  # f(2) is not a number: a name, like x


def _contradicts(eq: Equation, fa: Flags) -> bool:
    """An equation whose constant sides differ from its value (``3 = 4``, ``x = 4 = 3``) states no
    value: read as its last side, it would let a hedge pass (``x = 4 = 3`` for 3). Skipped under a
    degree or percent sign, which belongs to one side only (``\\sin 30^\\circ = \\frac{1}{2}``)."""
    if fa.degrees or fa.percent or not _is_constant(eq.rhs):
        return False  # 1 = x^2 + y^2 is an equation in x and y, not a false statement
    return any(_is_constant(side) and not values_equal(side, eq.rhs, fa, fa) for side in eq.sides)


def values_equal(a, b, fa: Flags = Flags(), fb: Flags = Flags()) -> bool:
    """Whether parsed answers ``a`` (prediction) and ``b`` (reference) are equivalent."""
    if isinstance(a, Equation) and _contradicts(a, fa):
        return False
    la, lb = _letter(a), _letter(b)
    if isinstance(a, Choice) or isinstance(b, Choice):
        return la is not None and la == lb
    if isinstance(a, Text) or isinstance(b, Text):
        ta, tb = _plain_text(a), _plain_text(b)
        return ta is not None and tb is not None and ta.replace(" ", "") == tb.replace(" ", "")
    if isinstance(a, Equation) and isinstance(b, Equation):
        return _equations_equal(a, b, fa, fb)
    if isinstance(a, Equation):
        return values_equal(a.rhs, b, fa, fb)
    if isinstance(b, Equation):
        return values_equal(a, b.rhs, fa, fb)
    a, b = _single(a), _single(b)
    if isinstance(a, Seq) and isinstance(b, Seq):
        return _seq_equal(a, b, fa, fb)
    if isinstance(a, Union) and isinstance(b, Union) and _multiset_equal(a.parts, b.parts, fa, fb):
        return True
    if isinstance(a, Union) or isinstance(b, Union):
        return _relation_vs_set(a, b)  # [1,2] \cup [2,3] ~ [1,3]; x<1 \lor x>2 forms
    if isinstance(a, Matrix) and isinstance(b, Matrix):
        return len(a.rows) == len(b.rows) and all(
            _ordered_equal(ra, rb, fa, fb) for ra, rb in zip(a.rows, b.rows))
    if isinstance(a, Matrix) or isinstance(b, Matrix):
        m, other = (a, b) if isinstance(a, Matrix) else (b, a)
        entries = _matrix_entries(m)
        if entries is None or not isinstance(other, Seq) or other.kind == "set":
            return False
        return _ordered_equal(entries, other.items, fa, fb) if m is a else _ordered_equal(other.items, entries, fa, fb)
    if isinstance(a, Scalar) and isinstance(b, Scalar):
        return scalars_equal(a, b, fa, fb)
    if isinstance(a, Scalar) or isinstance(b, Scalar):
        return _relation_vs_set(a, b)
    return False


def _as_real_set(v):
    """A SymPy set for an interval, a union of intervals, or a one-variable inequality."""
    from megatron_rl.reward.math.symbolic import interval_set, relation_set

    if isinstance(v, Scalar):
        return relation_set(v)
    if isinstance(v, Seq) and v.kind == "ordered" and len(v.items) == 2:
        lo, hi = v.items
        if isinstance(lo, Scalar) and isinstance(hi, Scalar):
            return interval_set(v.left, lo, hi, v.right)
    if isinstance(v, Union):
        import sympy

        parts = [_as_real_set(p) for p in v.parts]
        return None if any(p is None for p in parts) else sympy.Union(*parts)
    return None


def _relation_vs_set(a, b) -> bool:
    """``x \\ge 3`` ~ ``[3, \\infty)``: compare as sets of reals."""
    from megatron_rl.reward.math.symbolic import Unparseable

    try:
        sa, sb = _as_real_set(a), _as_real_set(b)
        return sa is not None and sb is not None and bool(sa == sb)
    except (Unparseable, TypeError, ValueError, AttributeError, NotImplementedError):
        return False


# "3,5": a decimal comma, or the list 3, 5 (a thousands group, "1,000", was joined by normalize)
_DECIMAL_COMMA = re.compile(r"^[+-]?\d+,\d+$")


def normalized_equal(pred: Normalized, ref: Normalized) -> bool:
    """Entry point used by the workers: structure both sides, then compare."""
    if pred.text == ref.text and pred.percent == ref.percent and pred.degrees == ref.degrees:
        return True
    fa, fb = Flags(pred.percent, pred.degrees), Flags(ref.percent, ref.degrees)
    a, b = parse_text(pred.text), parse_text(ref.text)
    if isinstance(b, Scalar) and _DECIMAL_COMMA.match(pred.text):
        # against one value the list reading cannot be right, so the comma is a decimal one
        # (written so in most of Europe: 3,5 = 3.5); a list reference keeps the list reading
        a = parse_text(pred.text.replace(",", "."))
    return values_equal(a, b, fa, fb)
