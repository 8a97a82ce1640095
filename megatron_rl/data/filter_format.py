"""Format filtering of raw math problem sets (Magistral's data curation, first pass).

`format_filter(rows) -> FormatReport`: each row {"id"?, "problem" | "prompt", "answer", "choices"?}
is kept, converted, or dropped with one reason:
- `proof`: the problem asks for a proof ("prove", "show that", ...): no single answer to check;
- `multi_part`: several sub-questions ((a)/(b), (i)/(ii), "Part 1"/"Part 2"): one answer cannot
  grade them;
- multiple choice (a `choices` list/dict, or "(A) ... (B) ..." options in the text) is turned into
  an open question when the answer is a letter (or the text) of an option that is a verifiable
  answer and the question does not select among its options ("which ...", "the following", "pick",
  "choose", a stem ending in ":"), as "What is 4 + 5?" with options 7, 8, 9 and answer C becomes
  {"problem": "What is 4 + 5?", "answer": "9"}; else `multiple_choice`;
- `no_answer`, `guessable_answer` (yes/no/true/false), `answer_has_words` (prose, e.g. "98
  values" or "no solutions"), `unparseable_answer` (the math verifier's LaTeX parser rejects it),
  `too_long_answer`: the answer cannot be verified reliably. Checks use `megatron_rl.reward.math`'s
  normaliser, structure parser and SymPy front end (the same code that grades rollouts).
Counts of each reason are reported; kept rows become JSONL problems for `data.sources.read_jsonl`.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_PROOF = re.compile(r"\b(prove|proof|show that|demonstrate that|justify (?:that|your)|verify that)\b", re.I)
_PART_MARKS = [
    re.compile(r"(?:^|\s)\(?a\)\s.*?(?:^|\s)\(?b\)\s", re.S),
    re.compile(r"(?:^|\s)\(i\)\s.*?(?:^|\s)\(ii\)\s", re.S),
    re.compile(r"\bpart\s*(?:1|one|\(?a\)?)\b.*\bpart\s*(?:2|two|\(?b\)?)\b", re.S | re.I),
]
_OPTION = re.compile(r"(?:^|\s)\(([A-E])\)\s*(.+?)(?=\s*\([A-E]\)\s|$)", re.S)
_OPTION_LINE = re.compile(r"^\s*([A-E])[.)]\s+(.+?)\s*$", re.M)
# A stem that selects among its options ("Which number is a square?", "Pick the largest:") has no
# single answer once they are gone: converting it would train on a question the reference cannot grade.
_REFERS_TO_OPTIONS = re.compile(r"\b(which|following|these|those|above|below|listed|among|options?|choices?|"
                                r"pick|choose|select)\b|:\s*$", re.I)
_GUESSABLE = {"yes", "no", "true", "false"}
_LATEX_CMD = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{3,}")
MAX_ANSWER_CHARS = 200


@dataclass
class FormatReport:
    kept: list[dict[str, Any]] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    converted_multiple_choice: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> a few dropped ids

    def summary(self) -> dict[str, Any]:
        return {"kept": len(self.kept), "dropped": sum(self.dropped.values()),
                "dropped_by_reason": dict(sorted(self.dropped.items())),
                "converted_multiple_choice": self.converted_multiple_choice}


def answer_verdict(answer: Any) -> str | None:
    """None when the answer can be verified by reward.math, else the reason it cannot."""
    from megatron_rl.reward.math.normalize import normalize
    from megatron_rl.reward.math.parse import Choice, Equation, Scalar, Seq, Text, parse_answer
    from megatron_rl.reward.math.symbolic import Unparseable, to_sympy

    if answer is None or isinstance(answer, bool) or not str(answer).strip():
        return "no_answer"
    text = str(answer).strip()
    if len(text) > MAX_ANSWER_CHARS:
        return "too_long_answer"
    if text.lower().strip(" .") in _GUESSABLE:
        return "guessable_answer"
    parsed = parse_answer(normalize(text))

    def leaves(v):
        if isinstance(v, Seq):
            for x in v.items:
                yield from leaves(x)
        elif isinstance(v, Equation):
            yield from leaves(v.rhs)
        else:
            yield v

    for leaf in leaves(parsed):
        if isinstance(leaf, Text):
            return "answer_has_words"
        if isinstance(leaf, Choice):
            return "multiple_choice"
        if isinstance(leaf, Scalar) and leaf.number is None:
            if _WORD.search(_LATEX_CMD.sub(" ", leaf.source)):  # "98 values" would parse as 98*v*a*l*u*e*s
                return "answer_has_words"
            try:
                to_sympy(leaf.source)
            except Unparseable:
                return "unparseable_answer"
    return None


def _options(row: dict[str, Any], text: str) -> tuple[dict[str, str], str]:
    """(letter -> option text, problem text without the options) or ({}, text)."""
    choices = row.get("choices") or row.get("options")
    if isinstance(choices, dict):
        return {str(k).strip().upper(): str(v).strip() for k, v in choices.items()}, text
    if isinstance(choices, list) and choices:
        return {chr(ord("A") + i): str(v).strip() for i, v in enumerate(choices)}, text
    for pattern in (_OPTION_LINE, _OPTION):
        found = pattern.findall(text)
        letters = [l for l, _ in found]
        if len(found) >= 2 and letters == sorted(letters) and letters[0] == "A":
            first = pattern.search(text)
            return {l: o.strip() for l, o in found}, text[: first.start()].rstrip()
    return {}, text


def _letter(answer: Any) -> str | None:
    m = re.fullmatch(r"\s*\(?\s*([A-Ea-e])\s*\)?\s*\.?\s*", str(answer))
    return m.group(1).upper() if m else None


def classify(row: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """(drop reason or None, the kept/converted row or None)."""
    text = row.get("problem", row.get("prompt"))
    if not isinstance(text, str) or not text.strip():
        return "no_problem", None
    if _PROOF.search(text):
        return "proof", None
    options, stem = _options(row, text)
    answer = row.get("answer")
    converted = False
    if options:
        letter = _letter(answer)
        if letter is None and str(answer).strip() in options.values():
            letter = next(k for k, v in options.items() if v == str(answer).strip())
        if letter is None or letter not in options or _REFERS_TO_OPTIONS.search(stem):
            return "multiple_choice", None
        answer, text, converted = options[letter], stem, True
    if any(p.search(text) for p in _PART_MARKS):
        return "multi_part", None
    reason = answer_verdict(answer)
    if reason is not None:
        return reason, None
    out = {k: v for k, v in row.items() if k not in ("choices", "options", "prompt")}
    out.update(problem=text.strip(), answer=str(answer).strip())
    if converted:
        out["converted_from_multiple_choice"] = True
    return None, out


def format_filter(rows: list[dict[str, Any]], n_examples: int = 5) -> FormatReport:
    report = FormatReport()
    for i, row in enumerate(rows):
        reason, out = classify(row)
        if reason is None:
            report.kept.append(out)
            report.converted_multiple_choice += bool(out.get("converted_from_multiple_choice"))
        else:
            report.dropped[reason] += 1
            ex = report.examples.setdefault(reason, [])
            if len(ex) < n_examples:
                ex.append(str(row.get("id", i)))
    return report
