"""Answer extraction: the content of the LAST ``\\boxed{}`` / ``\\fbox{}`` in a response.

Pure string scanning (no regex backtracking, no parser), linear in the response length, so it is
safe to run in the caller's process even on hostile responses.
"""
from __future__ import annotations

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _match_brace(text: str, open_idx: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_idx`` (escaped ``\\{``/``\\}`` skipped), or None."""
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character: \{ and \} do not count as grouping
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _box_argument(text: str, start: int) -> tuple[str, int] | None:
    """Parse the argument of a box command whose name ends at ``start``.

    Returns (content, end_index) or None when the argument is missing or unbalanced.
    Accepts ``\\boxed{..}``, ``\\boxed {..}`` and the brace-less ``\\boxed 5`` style (the run of
    non-space characters up to whitespace or ``$``, minus trailing punctuation).
    """
    n = len(text)
    i = start
    while i < n and text[i] in " \t\n":
        i += 1
    if i >= n:
        return None
    if text[i] == "{":
        close = _match_brace(text, i)
        if close is None:
            return None
        return text[i + 1 : close], close + 1
    if i == start and text[i].isalpha():
        return None  # "\boxedfoo" is another command, not a box
    j = i
    while j < n and not text[j].isspace() and text[j] != "$":
        j += 1
    token = text[i:j].rstrip(".,;")
    if not token:
        return None
    return token, j


def _box_at(text: str, j: int) -> tuple[str, int] | None:
    """(content, end) of a box command starting at index ``j``, or None."""
    for cmd in _BOX_COMMANDS:
        if text.startswith(cmd, j):
            return _box_argument(text, j + len(cmd))
    return None


def find_boxes(text: str) -> list[str]:
    """Contents of all outermost box commands, in order of appearance."""
    out: list[str] = []
    i = 0
    while True:
        j = text.find("\\", i)
        if j < 0:
            return out
        parsed = _box_at(text, j)
        if parsed is None:
            i = j + 1
        else:
            out.append(parsed[0])
            i = parsed[1]


def extract_answer(response: str) -> str | None:
    """Content of the last ``\\boxed{}`` (or ``\\fbox{}``) of ``response``; None if there is none.

    A box whose whole content is another box is unwrapped (``\\boxed{\\boxed{5}}`` -> ``5``).
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be str, got {type(response).__name__}")
    boxes = find_boxes(response)
    if not boxes:
        return None
    answer = boxes[-1].strip()
    while True:
        parsed = _box_at(answer, 0)
        if parsed is None or answer[parsed[1]:].strip():
            return answer
        answer = parsed[0].strip()
