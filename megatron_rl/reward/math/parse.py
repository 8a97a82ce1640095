"""Structure of a normalised answer: choice letter, text, set, tuple/interval, list, union,
matrix, equation, or a scalar expression (parsed lazily to SymPy by math.symbolic).

Only the top level is split here (by bracket depth); leaves stay strings until compared, so the
cheap cases (plain numbers, letters, words) never touch the LaTeX parser.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from megatron_rl.reward.math.normalize import Normalized, strip_group_braces

_OPEN = "([{"
_CLOSE = ")]}"


@dataclass(frozen=True)
class Scalar:
    source: str  # normalised LaTeX of one expression
    number: Fraction | None = None  # set when the source is a plain rational literal (exact value)
    # Set when the source is a decimal literal (``3.1416``, ``6.02 \times 10^{23}``, ``1e3``): the
    # power of ten of its last written digit, negated (3.1416: 4; 6.02e23: -21). Such a reference may
    # stand for a rounded value (rounds_to below); its exact value is still ``number``.
    decimals: int | None = None
    sig_digits: int = 0  # significant digits written in a decimal literal


@dataclass(frozen=True)
class Text:
    words: str  # lower-case, single-spaced


@dataclass(frozen=True)
class Choice:
    letter: str  # upper-case A-Z


@dataclass(frozen=True)
class Seq:
    kind: str  # "set" (\{..\}), "ordered" (brackets), "list" (bare commas: order-free)
    items: tuple
    left: str = ""  # "(" or "[" for ordered
    right: str = ""  # ")" or "]" for ordered


@dataclass(frozen=True)
class Union:
    parts: tuple


@dataclass(frozen=True)
class Matrix:
    rows: tuple  # tuple of tuples of values


@dataclass(frozen=True)
class Equation:
    lhs: str
    rhs: object  # a value
    # every side but the last, parsed (``x = 2 \cdot 3 = 6``: x, 2 \cdot 3): a side that is a constant
    # states a value too, so it must equal the last (``3 = 4``, ``x = 4 = 3`` state nothing)
    sides: tuple = ()


MIN_ROUNDING_SIG = 4  # a decimal reference with fewer significant digits is taken as exact


def rounds_to(value: Fraction, ref: Scalar) -> bool:
    """Whether ``value``, written to the last place of the decimal reference ``ref``, gives ``ref``
    (rounded to nearest, or truncated toward zero: 0.6667 and 0.6666 both stand for 2/3).

    Only a decimal *reference* with >= 4 significant digits is read as a rounded value: the
    problem's author wrote an approximation, so any prediction that rounds to it answers it.
    A decimal prediction against an exact reference gets no such reading (see the package __init__)."""
    if ref.decimals is None or ref.number is None or ref.sig_digits < MIN_ROUNDING_SIG:
        return False
    unit = Fraction(10) ** -ref.decimals  # one unit in the reference's last written place
    scaled, target = value / unit, ref.number / unit  # target is an integer
    return target == math.trunc(scaled) or abs(scaled - target) <= Fraction(1, 2)


_NUMBER = re.compile(r"^([+-]?)(\d+)(?:\.(\d*))?$|^([+-]?)\.(\d+)$")
# normalize() writes 1e3 / 1.5E-3 as "1\\times 10^{3}"; people write \\cdot too
_SCIENTIFIC = re.compile(r"^([+-]?)(\d+)(?:\.(\d*))?\s*\\(?:times|cdot)\s*10\s*\^\s*(?:\{\s*([+-]?\d+)\s*\}|(\d))$")
_MAX_DIGITS = 4000  # longer literals go to the (time-limited) general path
_SIMPLE_FRAC = re.compile(r"^([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}$|^([+-]?\d+)\s*/\s*([+-]?\d+)$")
# numbers side by side with only spaces between (thousands groups were joined by normalize)
_SPACED_NUMBERS = re.compile(r"^[+-]?\d+(?:\.\d+)?(?: +\d+(?:\.\d+)?)+$")
_CHOICE = re.compile(r"^\(\s*([A-Za-z])\s*\)(?:\s.*)?$|^([A-Z])[.):]?$|^\\?(?:text)?\{?\(?([A-Z])\)?\}?$")
# In the text after "(B) ": another choice ("(B) (C)", "(B) or C", "(B), (D)", "(B) C") makes the
# answer a list of choices, not B followed by its content ("(B) 5", "(B) x = 3", "(B) x^3 + C").
_OTHER_CHOICE = re.compile(r"\(\s*[A-Za-z]\s*\)|^\s*(?:or|and|[,;/&|])|^\s*[A-Za-z]\W*$")
_WORDS = re.compile(r"^[A-Za-z][A-Za-z' \-]*[A-Za-z]$")
_MATH_WORDS = {
    "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "pi", "sqrt", "infty", "arcsin",
    "arccos", "arctan", "sinh", "cosh", "tanh", "det", "max", "min", "gcd", "lcm", "mod", "frac",
}
_MATRIX = re.compile(r"^\\begin\{([pbvBV]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}$", re.S)


def _scientific(s: str) -> Scalar | None:
    m = _SCIENTIFIC.match(s)
    if m is None:
        return None
    sign, whole, frac, exp = m.group(1), m.group(2), m.group(3) or "", int(m.group(4) or m.group(5))
    if len(whole) + len(frac) > _MAX_DIGITS or abs(exp) > _MAX_DIGITS:
        return None
    value = Fraction(int(whole + frac)) * Fraction(10) ** (exp - len(frac))
    digits = (whole + frac).lstrip("0")
    return Scalar(s, -value if sign == "-" else value, decimals=len(frac) - exp, sig_digits=len(digits))


def _number(s: str) -> Scalar | None:
    sci = _scientific(s)
    if sci is not None:
        return sci
    m = _NUMBER.match(s)
    if m:
        if m.group(2) is not None:
            sign, whole, frac = m.group(1), m.group(2), m.group(3)
        else:
            sign, whole, frac = m.group(4), "0", m.group(5)
        if len(whole) + len(frac or "") > _MAX_DIGITS:
            return None  # leave absurd literals to the (time-limited) general path
        value = Fraction(int(whole + (frac or "")), 10 ** len(frac or ""))
        value = -value if sign == "-" else value
        if frac is None:
            return Scalar(s, value)
        digits = (whole + frac).lstrip("0")
        return Scalar(s, value, decimals=len(frac), sig_digits=len(digits))
    m = _SIMPLE_FRAC.match(s)
    if m:
        if m.group(2) is not None:
            sign, num, den = m.group(1), int(m.group(2)), int(m.group(3))
        else:
            sign, num, den = "", int(m.group(4)), int(m.group(5))
        if den == 0 or max(abs(num), abs(den)) > 10**_MAX_DIGITS:
            return None
        value = Fraction(num, den)
        return Scalar(s, -value if sign == "-" else value)
    return None


def split_top(s: str, sep: str) -> list[str]:
    """Split on ``sep`` where it is outside every bracket (``\\{`` counts as a bracket)."""
    parts, depth, start, i, n, k = [], 0, 0, 0, len(s), len(sep)
    while i < n:
        ch = s[i]
        if ch == "\\" and i + 1 < n and s[i + 1] in "{}":
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        if s.startswith("\\begin{", i) or s.startswith("\\langle", i):
            depth += 1
        elif s.startswith("\\end{", i) or s.startswith("\\rangle", i):
            depth -= 1
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i += k
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _outer_bracket(s: str) -> tuple[str, str, str] | None:
    """(left, inner, right) when s is one bracketed group spanning the whole string."""
    if len(s) < 2 or s[0] not in "([" or s[-1] not in ")]":
        return None
    depth = 0
    for i, ch in enumerate(s):
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth == 0 and i != len(s) - 1:
                return None
    return s[0], s[1:-1], s[-1]


def _set_body(s: str) -> str | None:
    if s.startswith("\\{") and s.endswith("\\}"):
        inner = s[2:-2]
        # "\{1\} \cup \{2\}" is not one set: the first \} must be the last one at depth 0
        if len(split_top(inner, "\\}")) == 1:
            return inner
    return None


def _choice(s: str) -> Choice | None:
    m = _CHOICE.match(s)
    if m is None:
        return None
    if m.group(1) and _OTHER_CHOICE.search(s[s.index(")", m.start(1)) + 1 :]):
        return None  # several choices: a list that grades as no single letter
    return Choice((m.group(1) or m.group(2) or m.group(3)).upper())


def _is_words(s: str) -> bool:
    if not _WORDS.match(s):
        return False
    words = s.lower().replace("-", " ").split()
    return any(len(w) >= 3 and w not in _MATH_WORDS for w in words) or words == ["no"]


def _expand_pm(s: str) -> Seq | None:
    for op in ("\\pm", "\\mp"):
        i = s.find(op)
        if i >= 0 and not s[i + len(op) : i + len(op) + 1].isalpha():
            head, tail = s[:i], s[i + len(op) :]
            first, second = ("+", "-") if op == "\\pm" else ("-", "+")
            return Seq("list", (parse_text(head + first + tail), parse_text(head + second + tail)))
    return None


def parse_text(s: str) -> object:
    """Structure of a normalised answer string (see module doc)."""
    s = strip_group_braces(s.strip())  # an item may be braced too: (\{1\}, {2})
    if s in ("\\emptyset", "\\varnothing", "\\{\\}", "\\{ \\}", "{}"):
        return Seq("set", ())
    num = _number(s)
    if num is not None:
        return num
    if _SPACED_NUMBERS.match(s):
        return Text(s)  # "3 4": no value (the LaTeX parser would add them: 7); equal only as written
    choice = _choice(s)
    if choice is not None:
        return choice
    if _is_words(s):
        return Text(" ".join(s.lower().split()))
    pm = _expand_pm(s)
    if pm is not None:
        return pm
    parts = split_top(s, "\\cup")
    if len(parts) > 1:
        return Union(tuple(parse_text(p) for p in parts))
    commas = split_top(s, ",")
    if len(commas) == 1:
        commas = split_top(s, ";")
    if len(commas) > 1:
        items = [c.strip() for c in commas if c.strip()]
        if "=" in items[0] and not all(_top_eq(c) for c in items):
            lhs, _, rhs = items[0].partition("=")
            rest = ", ".join([rhs] + items[1:])
            return Equation(_lhs_key(lhs), parse_text(rest), (parse_text(lhs),))
        return Seq("list", tuple(parse_text(c) for c in items))
    eq = _top_eq(s)
    if eq is not None:
        *sides, rhs = eq
        return Equation(_lhs_key(sides[0]), parse_text(rhs), tuple(parse_text(p) for p in sides))
    body = _set_body(s)
    if body is not None:
        items = [c.strip() for c in split_top(body, ",") if c.strip()]
        return Seq("set", tuple(parse_text(c) for c in items))
    br = _outer_bracket(s) or _angle(s)
    if br is not None:
        left, inner, right = br
        items = split_top(inner, ",")
        if len(items) > 1:
            return Seq("ordered", tuple(parse_text(c) for c in items), left, right)
        if left == "(" and right == ")":
            return parse_text(inner)
    m = _MATRIX.match(s)
    if m:
        rows = [r for r in split_top(m.group(2), "\\\\") if r.strip()]
        return Matrix(tuple(tuple(parse_text(c) for c in split_top(r, "&")) for r in rows))
    return Scalar(s)


def _angle(s: str) -> tuple[str, str, str] | None:
    if s.startswith("\\langle") and s.endswith("\\rangle"):
        return "(", s[len("\\langle") : -len("\\rangle")], ")"
    return None


def _top_eq(s: str) -> tuple[str, ...] | None:
    """The sides of a top-level ``=`` (``\\in`` too), left to right (a chain a=b=c has three)."""
    for sep in ("=", "\\in "):
        parts = split_top(s, sep)
        if len(parts) > 1 and all(p.strip() for p in parts):
            return tuple(p.strip() for p in parts)
    return None


def _lhs_key(lhs: str) -> str:
    return "".join(lhs.split())


def parse_answer(norm: Normalized) -> object:
    return parse_text(norm.text)
