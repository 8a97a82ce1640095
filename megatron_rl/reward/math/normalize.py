"""String normalisation of a LaTeX answer before it is parsed.

Removes presentation-only LaTeX (``\\left``, ``\\!``, ``\\,``, ``\\displaystyle``, ``$``), units, the
degree sign and the percent sign (remembered as flags: their meaning is decided in comparison),
trailing punctuation, thousands separators, and rewrites shorthands (``\\frac12``, ``\\sqrt8``, ``1e3``,
``\\dfrac``) into forms the LaTeX parser accepts. Regexes here are linear (no nested quantifiers).
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from megatron_rl.reward.math.extract import _match_brace, pair_braces


@dataclass(frozen=True)
class Normalized:
    """A normalised answer string and what was stripped from it."""

    text: str
    percent: bool = False  # had a % sign (or the word "percent")
    degrees: bool = False  # had ^\circ / ° / the word "degrees"


_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u00d7": r"\times ", "\u22c5": r"\cdot ", "\u00b7": r"\cdot ",
    "\u00f7": r"\div ", "\u03c0": r"\pi ", "\u221a": r"\sqrt", "\u221e": r"\infty ", "\u00b0": r"^\circ",
    "\u2264": r"\le ", "\u2265": r"\ge ", "\u222a": r"\cup ", "\u00b1": r"\pm ", "\u2213": r"\mp ",
    "\u2205": r"\emptyset ", "\u00a0": " ",
    # other minus-like dashes, the fraction slash, CJK punctuation (fullwidth forms: _FULLWIDTH)
    "\u2010": "-", "\u2011": "-", "\u2012": "-", "\ufe63": "-", "\u2044": "/", "\u3001": ",", "\u3002": ".",
    "\u3000": " ",
}
# Fullwidth ASCII (U+FF01..U+FF5E, typed in CJK text: "（Ｂ）", "３．５", "－５") is plain ASCII
_FULLWIDTH = {c: c - 0xFEE0 for c in range(0xFF01, 0xFF5F)}
_SUPERSCRIPT = str.maketrans("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b",
                             "0123456789+-")
_SUPERSCRIPTS = re.compile("[\u2070\u00b9\u00b2\u00b3\u2074-\u207b]+")  # x² -> x^{2}, 2⁻¹ -> 2^{-1}
_VULGAR = re.compile("[\u00bc-\u00be\u2150-\u215e]")  # ½ -> \frac{1}{2} (1½: a mixed number)
_SPACING = re.compile(r"(?<!\\)\\(?:!|,|;|:| |quad(?![a-zA-Z])|qquad(?![a-zA-Z])|enspace(?![a-zA-Z])|thinspace(?![a-zA-Z])|medspace(?![a-zA-Z]))|~")
_SIZING = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg|middle)(?![a-zA-Z])\s*\.?")
_STYLE = re.compile(r"\\(?:displaystyle|textstyle|scriptstyle|limits|nolimits)(?![a-zA-Z])")
_FRAC_NAMES = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_BINOM_NAMES = re.compile(r"\\[dt]binom(?![a-zA-Z])")
_DEGREE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![a-zA-Z])|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])")
_PERCENT = re.compile(r"\\%|%")
_TEXT_CMDS = ("\\text", "\\textbf", "\\textit", "\\textrm", "\\textnormal", "\\mbox", "\\mathrm",
              "\\mathbf", "\\mathit", "\\boldsymbol", "\\bm", "\\textsf", "\\mathsf", "\\hbox")
_UNIT_WORDS = (
    "square units|sq units|square feet|square inches|square meters|square centimeters|cubic feet|"
    "cubic inches|cubic meters|cubic centimeters|units|unit|cm|mm|km|m|meters|meter|metres|metre|"
    "centimeters|centimeter|kilometers|kilometer|millimeters|inches|inch|in|feet|foot|ft|yards|yard|"
    "miles|mile|mph|kg|g|grams|gram|kilograms|mg|lb|lbs|pounds|pound|ounces|oz|s|sec|seconds|second|"
    "min|minutes|minute|h|hr|hrs|hours|hour|days|day|weeks|week|months|month|years|year|dollars|dollar|"
    "cents|cent|l|liters|liter|litres|ml|gallons|gallon|degrees|degree|deg|radians|rad|"
    "percent|people|students|ways|items|points|times"
)
_TRAILING_UNIT = re.compile(r"(?<=[\d}).\s])\s*(?:" + _UNIT_WORDS + r")(?:\s*\^\s*\{?[23]\}?)?\s*$")
_SCI = re.compile(r"(?<![a-zA-Z\d.])(\d+(?:\.\d+)?)\s*[eE]\s*([+-]?\d+)(?![\d.])")
# A group that starts with 0 is never a thousands group: "0,125" is a decimal comma (or a list)
_THOUSANDS_WHOLE = re.compile(r"^-?(?!0)\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_THOUSANDS_BRACED = re.compile(r"(?<![\d.])(?!0)\d{1,3}(?:\{,\}\d{3})+(?!\d)")
_DECIMAL_BRACED = re.compile(r"(?<=\d)\{,\}(?=\d)")  # 3{,}5: LaTeX's decimal comma, the other {,}
_THOUSANDS_SPACE = re.compile(r"(?<![\d.])(?!0)\d{1,3}(?: \d{3})+(?![\d.])")
_FRAC_SHORT = [
    (re.compile(r"\\frac\s*(\\[a-zA-Z]+)"), r"\\frac{\1}"),  # \frac\pi2 (then \frac{\pi}2 below)
    (re.compile(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*([0-9a-zA-Z])\s*\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*([0-9a-zA-Z])"), r"\\frac\1{\2}"),
    (re.compile(r"\\sqrt\s*(\d+|[a-zA-Z](?![a-zA-Z]))"), r"\\sqrt{\1}"),
]
_NUMBER_THEN_WORDS = re.compile(r"^([-+]?\d[\d,]*(?:\.\d+)?)\s+[A-Za-z][A-Za-z' /-]*$")
_REPEATING = re.compile(r"(?<![\d.])(\d*)\.(\d*)\\overline\s*\{(\d{1,50})\}")
_INFINITY = re.compile(r"\\infinity(?![a-zA-Z])|(?<![a-zA-Z\\])(?:infinity|inf)(?![a-zA-Z])", re.I)  # Infinity, INF
_SIGNED_EXPONENT = re.compile(r"\^\s*([+-])\s*(\d+|[a-zA-Z](?![a-zA-Z]))")  # 10^-2 means 10^{-2}
# "The answer is 5", "Answer: 5", "La respuesta es 5", "答案是5": a lead-in of words ending in a
# copula or a colon, before a value that starts like math (or is one choice letter). The words are
# split by single spaces, so the split is unique and the match linear.
_COPULAS = "is|are|was|equals|es|est|ist|sind|é|è|er|är|jest|son|sont|era"
_LEAD_IN = re.compile(r"^[^\W\d_][^\W\d_'’]*(?: [^\W\d_][^\W\d_'’]*)*?(?: ?:| (?:" + _COPULAS + r")) ?"
                      r"(?=[-+\d\\(\[{.]|[A-Z]\W*$)")
_LEAD_IN_CJK = re.compile(r"^[\u3040-\u30ff\u4e00-\u9fff]{1,12}?(?:是|为|為|は|:) ?(?=[-+\d\\(\[{.]|[A-Z]\W*$)")
_RELATION = re.compile(r"[<>]|\\(?:le|ge|leq|geq|lt|gt|leqslant|geqslant)(?![a-zA-Z])")
_OR = re.compile(r"\s+or\s+|\\(?:lor|vee)(?![a-zA-Z])")
_UNIT_TAIL = re.compile(r"^\s*(?:\^\s*\{?[23]\}?)?\s*\.?\s*$")
_UNIT_MARK = re.compile(r"\x00\s*(?:\^\s*\{?[23]\}?)?")
_WORDY_UNIT = re.compile(r"^[A-Za-z][A-Za-z ./]*(?:\^\{?[23]\}?)?$")


def _unwrap_command(s: str, cmd: str, keep) -> str:
    """Replace every ``cmd{arg}`` by ``keep(arg, before, after)``; brace-matched, linear."""
    out = []
    i = 0
    while True:
        j = s.find(cmd, i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        k = j + len(cmd)
        if k < len(s) and s[k].isalpha():  # a longer command name (\textbf vs \text)
            out.append(s[i:k])
            i = k
            continue
        while k < len(s) and s[k] == " ":
            k += 1
        close = _match_brace(s, k) if k < len(s) and s[k] == "{" else None
        if close is None:
            out.append(s[i:k])
            i = k
            continue
        out.append(s[i:j])
        out.append(keep(s[k + 1 : close], "".join(out), s[close + 1 :]))
        i = close + 1


def _strip_text_units(s: str) -> str:
    """Drop a trailing ``\\text{cm}``-style unit that follows some math (``5\\text{ cm}`` -> ``5``)."""
    for cmd in _TEXT_CMDS:
        def keep(arg: str, before: str, after: str) -> str:
            word = arg.strip()
            if before.strip() and _UNIT_TAIL.match(after) and _WORDY_UNIT.match(word):
                # a lone letter after math is more likely a variable (\mathrm{m} stays m, not dropped)
                if len(word.replace(" ", "")) >= 2:
                    return "\x00"
            return cmd + "{" + arg + "}"
        s = _unwrap_command(s, cmd, keep)
    return _UNIT_MARK.sub(" ", s)


def _unwrap_text(s: str) -> str:
    for cmd in _TEXT_CMDS:
        s = _unwrap_command(s, cmd, lambda arg, b, a: " " + arg + " ")
    return s


def strip_group_braces(s: str) -> str:
    """``{42}`` -> ``42``, ``{{x+1}}`` -> ``x+1``, ``{\\frac{1}{2}}`` -> ``\\frac{1}{2}``: braces that
    enclose the whole answer group nothing (the LaTeX parser would read ``{42}`` as the set {42}).

    Braces with a meaning are kept: ``\\{1,2\\}`` (escaped: a set), ``{1}{2}`` or ``\\frac{a}{b}``
    (the first brace closes before the end), ``{}`` (the empty set). Linear: braces are paired
    once (math.extract.pair_braces), then peeled from both ends."""
    if not s.startswith("{"):
        return s
    close = pair_braces(np.frombuffer(s.encode("utf-32-le", "surrogatepass"), dtype=np.uint32))
    lo, hi = 0, len(s)  # s[lo:hi] is the current answer, stripped
    while hi - lo >= 2 and s[lo] == "{" and close[lo] == hi - 1:
        inner_lo, inner_hi = lo + 1, hi - 1
        while inner_lo < inner_hi and s[inner_lo].isspace():
            inner_lo += 1
        while inner_hi > inner_lo and s[inner_hi - 1].isspace():
            inner_hi -= 1
        if inner_lo == inner_hi:
            break  # "{}" / "{ }": the empty set, not an empty group
        lo, hi = inner_lo, inner_hi
    return s[lo:hi]


def _repeating_to_frac(m: re.Match) -> str:
    """``0.1\\overline{6}`` -> ``\\frac{1}{6}`` (exact value of a repeating decimal)."""
    whole, fixed, rep = m.group(1) or "0", m.group(2), m.group(3)
    k, r = len(fixed), len(rep)
    num = int(whole + fixed + rep) - int(whole + fixed)
    den = (10**r - 1) * 10**k
    return "\\frac{%d}{%d}" % (num, den)


def _unicode_math(s: str) -> str:
    """Unicode spellings of ASCII and LaTeX: fullwidth forms, superscripts, vulgar fractions."""
    s = s.translate(_FULLWIDTH)
    for k, v in _UNICODE.items():
        if k in s:
            s = s.replace(k, v)
    s = _SUPERSCRIPTS.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPT) + "}", s)
    return _VULGAR.sub(_vulgar_to_frac, s)


def _vulgar_to_frac(m: re.Match) -> str:
    q = Fraction(unicodedata.numeric(m.group(0))).limit_denominator(10)
    return "\\frac{%d}{%d}" % (q.numerator, q.denominator)


def normalize(answer: str) -> Normalized:
    """Normalise an answer string (already extracted from its box)."""
    s = _unicode_math(answer)
    s = s.replace("\\$", " ").replace("$", " ")
    s = s.replace("\\(", " ").replace("\\)", " ").replace("\\[", " ").replace("\\]", " ")
    s = strip_group_braces(s.strip())
    s = _SIZING.sub("", s)
    s = _STYLE.sub("", s)
    s = _THOUSANDS_BRACED.sub(lambda m: m.group(0).replace("{,}", ""), s)
    s = _DECIMAL_BRACED.sub(".", s)
    s = _SPACING.sub(" ", s)
    s = _FRAC_NAMES.sub(r"\\frac", s)
    s = _BINOM_NAMES.sub(r"\\binom", s)
    degrees = False
    if _DEGREE.search(s):
        degrees = True
        s = _DEGREE.sub(" ", s)
    percent = False
    if _PERCENT.search(s):
        percent = True
        s = _PERCENT.sub(" ", s)
    s = _strip_text_units(s)
    s = _unwrap_text(s)
    s = re.sub(r"\s+", " ", s).strip()
    s = s.rstrip(" .;,")  # trailing sentence punctuation
    for _ in range(3):  # "5 square units", "3 cm^2": a unit may follow a unit-less tail
        m = _TRAILING_UNIT.search(s)
        if m is None or not s[: m.start()].strip():
            break
        word = m.group(0).strip().lower()
        if word.startswith("degree") or word.startswith("deg"):
            degrees = True
        if word.startswith("percent"):
            percent = True
        s = s[: m.start()].rstrip(" .")
    m = _LEAD_IN.match(s) or _LEAD_IN_CJK.match(s)
    if m:
        s = s[m.end():]
    m = _NUMBER_THEN_WORDS.match(s)  # "5 apples" (a count followed by what is counted)
    if m:
        s = m.group(1)
    s = _REPEATING.sub(_repeating_to_frac, s)
    if s.lower().startswith("and "):
        s = s[4:]
    if _RELATION.search(s):  # x<-1 or x>3: the union of the two solution sets (parse: Union)
        s = _OR.sub(r" \\cup ", s)
    s = re.sub(r"\s+(?:and|or)\s+", ", ", s) if re.search(r"\d|\\", s) else s
    s = _INFINITY.sub(r"\\infty", s)
    for pat, rep in _FRAC_SHORT:
        s = pat.sub(rep, s)
    s = _SCI.sub(r"\1\\times 10^{\2}", s)
    s = _SIGNED_EXPONENT.sub(r"^{\1\2}", s)
    if _THOUSANDS_WHOLE.match(s):
        s = s.replace(",", "")
    s = _THOUSANDS_SPACE.sub(lambda m: m.group(0).replace(" ", ""), s)
    s = strip_group_braces(re.sub(r"\s+", " ", s).strip())  # again: units or "$" may have hidden some
    return Normalized(s, percent=percent, degrees=degrees)
