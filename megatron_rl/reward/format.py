"""Magistral's format gate: one `<think>` block, then an answer in the form the task needs.

Policy (decided here, tested in tests/unit/test_reward_format.py):
- The response holds exactly one ``<think>`` and exactly one ``</think>``, in that order.
- Only whitespace may precede ``<think>``: the system prompt asks the model to think first, and
  text before the block would be an answer given outside the format. (If a chat template pre-fills
  ``<think>`` in the prompt, the caller prepends it to the completion before grading.)
- The thoughts (between the tags) and the answer (everything after ``</think>``) are non-empty.
- math: the answer contains ``\\boxed{...}`` (``\\boxed {...}`` too) with balanced braces and a
  non-empty content; the grader later compares the final answer (the last box, with any boxes joined
  to it by connectives: math.extract.final_answer).
- code: the answer contains a closed, non-empty fenced block whose tag is the task's language
  (python: ``python``, ``py``, ``python3``; cpp: ``cpp``, ``c++``, ``cc``, ``cxx``); the LAST such
  block is the program that is run. A block in another language does not count.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from megatron_rl.reward.math.extract import BoxScan, unstripped_boxes
from megatron_rl.reward.types import CodeTask, Task

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

LANGUAGE_TAGS = {
    "python": "python", "py": "python", "python3": "python",
    "cpp": "cpp", "c++": "cpp", "cc": "cpp", "cxx": "cpp",
}
# A fenced block: an opening fence line (optional tag) ending in a newline, the body, then the first
# closing fence line (only ``` and spaces/tabs) that starts at least two lines below the opening one,
# i.e. after the newline that ends the body. Found from a list of fence lines, not by a lazy regex:
# a lazy body rescans the rest of the text for every unclosed opening (quadratic).
_FENCE_LINE = re.compile(r"^[ \t]*```[^\n]*", re.M)
_OPENING = re.compile(r"[ \t]*```[ \t]*([^\s`]*)")
_CLOSING_LINE = re.compile(r"^[ \t]*```[ \t]*$", re.M)


@dataclass(frozen=True)
class FormatResult:
    ok: bool
    reason: str = ""  # why the gate failed ("" when ok)
    thoughts: str = ""
    answer: str = ""  # text after </think>
    code: str | None = None  # code tasks: the program to run


def split_think(response: str) -> tuple[str, str] | str:
    """(thoughts, answer) of a well-formed response, or a string saying what is wrong."""
    n_open, n_close = response.count(THINK_OPEN), response.count(THINK_CLOSE)
    if n_open != 1 or n_close != 1:
        return f"expected exactly one {THINK_OPEN} and one {THINK_CLOSE}, found {n_open} and {n_close}"
    start, end = response.index(THINK_OPEN), response.index(THINK_CLOSE)
    if end < start:
        return f"{THINK_CLOSE} comes before {THINK_OPEN}"
    if response[:start].strip():
        return f"text before {THINK_OPEN}"
    thoughts = response[start + len(THINK_OPEN):end]
    answer = response[end + len(THINK_CLOSE):]
    if not thoughts.strip():
        return "empty thoughts"
    if not answer.strip():
        return f"nothing after {THINK_CLOSE}"
    return thoughts, answer


def _scan_boxed(text: str) -> BoxScan:
    # the gate's grammar: "\\boxed", any whitespace, then a brace group (no brace-less or \\fbox forms)
    return BoxScan(text, commands=("\\boxed",), braceless=False, any_space=True)


def boxed_contents(text: str) -> list[str]:
    """Contents of every outermost ``\\boxed{...}`` with balanced braces, in order (unclosed boxes
    skipped; a box nested in another is part of the outer one's content). Linear time: braces are
    paired once for the whole text (math.extract.BoxScan), never rescanned per box."""
    return [text[lo:hi] for _, lo, hi in unstripped_boxes(_scan_boxed(text))]


def has_nonempty_box(text: str) -> bool:
    """Whether some ``\\boxed{...}`` has non-blank content (without copying any content)."""
    return any(lo < hi for _, lo, hi in _scan_boxed(text).outermost())


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(normalised language or raw tag, code) of every closed fenced block, in order."""
    starts = [m.start() for m in _FENCE_LINE.finditer(text)]
    closing = [m.start() for m in _CLOSING_LINE.finditer(text)]
    blocks, i = [], 0
    while i < len(starts):
        start = starts[i]
        end = text.find("\n", start)  # the opening line must end in a newline
        if end < 0:
            break
        k = bisect.bisect_left(closing, end + 2)  # the body's final newline comes first
        if k == len(closing):
            break  # no closing line below this opening, so none below any later one either
        tag = _OPENING.match(text, start).group(1).lower()
        blocks.append((LANGUAGE_TAGS.get(tag, tag), text[end + 1:closing[k] - 1]))
        i = bisect.bisect_left(starts, closing[k] + 1)  # next fence line after the closing one
    return blocks


def check_format(task: Task, response: str) -> FormatResult:
    parts = split_think(response)
    if isinstance(parts, str):
        return FormatResult(False, parts)
    thoughts, answer = parts
    if isinstance(task, CodeTask):
        programs = [code for lang, code in fenced_blocks(answer) if lang == task.language and code.strip()]
        if not programs:
            return FormatResult(False, f"no fenced ```{task.language} block in the answer", thoughts, answer)
        return FormatResult(True, "", thoughts, answer, code=programs[-1])
    if not has_nonempty_box(answer):
        return FormatResult(False, "no non-empty \\boxed{} in the answer", thoughts, answer)
    return FormatResult(True, "", thoughts, answer)
