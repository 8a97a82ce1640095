"""Answer extraction: the content of the LAST ``\\boxed{}`` / ``\\fbox{}`` in a response.

Linear time on any input. A per-box scan for the closing brace is quadratic on hostile responses
(thousands of unclosed ``\\boxed{``, or boxes nested thousands deep, each rescan the rest of the
text), so ``BoxScan`` instead pairs every brace of the text once, in a few vectorised NumPy passes,
and precomputes per box command everything the box grammar asks (where its argument starts, where
that argument closes, where its whitespace-stripped content lies). The rules are walked in Python
only per box command, in O(1) each.

Box grammar (unchanged): ``\\boxed{..}``, ``\\boxed {..}`` (spaces, tabs, newlines before ``{``) and
the brace-less ``\\boxed 5`` (the run of non-space characters up to whitespace or ``$``, minus
trailing ``.,;``; ``\\boxedfoo`` is another command). ``\\{`` and ``\\}`` are not grouping braces (a
brace counts as escaped after an odd run of backslashes). Boxes are taken outermost first, left to
right: a box inside an earlier box's argument is part of that box, not a box of its own; a box
whose argument never closes is skipped, and the boxes inside it still count.

Grading reads ``final_answer``: the last box together with the boxes joined to it by connectives
only (``\\boxed{1} or \\boxed{2}`` is the answer "1, 2", not "2"); ``extract_answer`` is the last
box alone.
"""
from __future__ import annotations

import re

import numpy as np

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_OPEN, _CLOSE, _BACKSLASH, _DOLLAR = ord("{"), ord("}"), ord("\\"), ord("$")
# code points for which str.isspace() holds (all lie below U+3001): the strip() of the old scan
_ISSPACE = np.array([c for c in range(0x3001) if chr(c).isspace()], dtype=np.uint32)


def _match_brace(text: str, open_idx: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_idx`` (escaped ``\\{``/``\\}`` skipped), or None.

    One brace, O(length): for short, already extracted answers (math.normalize). Whole responses
    go through BoxScan."""
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


def pair_braces(codes: np.ndarray) -> np.ndarray:
    """For each position, the index of the ``}`` that closes a ``{`` there, else -1 (length n + 1:
    index n is a spare "no brace" slot).

    The result is what a stack scan gives (a stray ``}`` with nothing open is ignored), computed
    without a Python loop: the depth after each brace is the running sum of +1/-1 reflected at 0
    (sum - min(0, running min of sum)); at one depth, openings and the closings that leave it
    alternate in text order, so a stable sort by depth puts each ``{`` right before its ``}``.
    """
    n = codes.shape[0]
    close = np.full(n + 1, -1, dtype=np.int64)
    pos = np.flatnonzero((codes == _OPEN) | (codes == _CLOSE))
    if pos.size and pos[0] == 0:
        pos0, pos = pos[:1], pos[1:]
    else:
        pos0 = pos[:0]
    if pos.size:  # an odd run of backslashes right before a brace escapes it
        slashed = pos[codes[pos - 1] == _BACKSLASH]
        if slashed.size:
            is_bs = codes == _BACKSLASH
            run_start = np.flatnonzero(is_bs & ~np.insert(is_bs[:-1], 0, False))
            run = slashed - run_start[np.searchsorted(run_start, slashed - 1, side="right") - 1]
            pos = np.setdiff1d(pos, slashed[run % 2 == 1], assume_unique=True)
    pos = np.concatenate((pos0, pos))
    if pos.size == 0:
        return close
    is_open = codes[pos] == _OPEN
    total = np.cumsum(np.where(is_open, 1, -1).astype(np.int32))
    depth_after = total - np.minimum(np.minimum.accumulate(total), 0)
    depth_before = np.concatenate((np.zeros(1, np.int32), depth_after[:-1]))
    keep = is_open | (depth_before > 0)  # closings with nothing open are ignored
    pos, is_open = pos[keep], is_open[keep]
    key = np.where(is_open, depth_after[keep], depth_before[keep])
    order = np.argsort(key, kind="stable")  # stable: text order within one depth
    pos, is_open, key = pos[order], is_open[order], key[order]
    left = np.flatnonzero(is_open[:-1] & ~is_open[1:] & (key[:-1] == key[1:]))
    close[pos[left]] = pos[left + 1]
    return close


def _skip(mask: np.ndarray, query: np.ndarray) -> np.ndarray:
    """For each query index q, the first index >= q where ``mask`` is False (len(mask) if none).

    Searches the ends of the True runs (one binary search per query), so no per-position array
    of answers is built."""
    n = mask.shape[0]
    out = query.copy()
    q_in = query < n
    hit = np.zeros(query.shape[0], dtype=bool)
    hit[q_in] = mask[query[q_in]]
    if hit.any():
        run_end = np.flatnonzero(mask & ~np.append(mask[1:], False))  # last index of each True run
        out[hit] = run_end[np.searchsorted(run_end, query[hit])] + 1
    return out


def _back(mask: np.ndarray, query: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """For each query index q, 1 + the last index < q where ``mask`` is False, but at least floor."""
    out = query.copy()
    prev = query - 1
    ok = prev >= floor
    hit = np.zeros(query.shape[0], dtype=bool)
    hit[ok] = mask[prev[ok]]
    if hit.any():
        run_start = np.flatnonzero(mask & ~np.insert(mask[:-1], 0, False))  # first index of each run
        out[hit] = run_start[np.searchsorted(run_start, prev[hit], side="right") - 1]
    return np.maximum(out, floor)


def _is_space(codes: np.ndarray) -> np.ndarray:
    """str.isspace() of every character, by comparisons (np.isin only for the rare non-ASCII)."""
    mask = ((codes >= 9) & (codes <= 13)) | ((codes >= 28) & (codes <= 32))
    high = np.flatnonzero(codes >= 0x85)
    if high.size:
        mask[high] = np.isin(codes[high], _ISSPACE)
    return mask


def _find_all(codes: np.ndarray, slashes: np.ndarray, word: str) -> np.ndarray:
    """Start of every occurrence of ``word`` (which begins with a backslash)."""
    n, hit = codes.shape[0], slashes[slashes <= codes.shape[0] - len(word)]
    for i, ch in enumerate(word[1:], 1):
        hit = hit[codes[hit + i] == ord(ch)]
    return hit if n else hit[:0]


class BoxScan:
    """Every box command of one text, parsed once (see module doc); O(len(text)) to build.

    Per command t (in text order), as NumPy arrays: ``start``, ``arg`` (first character of its
    argument; n: none), ``braced``, ``close`` (the argument's closing brace; -1: none), ``lo``/``hi``
    (the braced content stripped of whitespace), ``after`` (first non-space after the closing
    brace), ``stop`` (end of a brace-less token), ``alpha`` (a letter right after the command name:
    another command, ``\\boxedfoo``)."""

    def __init__(self, text: str, commands=_BOX_COMMANDS, braceless: bool = True, any_space: bool = False):
        """``any_space``: any whitespace may precede the ``{`` (the format gate's ``\\s*``), else only
        space, tab and newline (the extraction grammar). ``braceless``: accept ``\\boxed 5``."""
        self.text, self.braceless = text, braceless
        n = self.n = len(text)
        codes = self._codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        slashes = np.flatnonzero(codes == _BACKSLASH)
        found = [(_find_all(codes, slashes, cmd), len(cmd)) for cmd in commands]
        start = np.concatenate([hits for hits, _ in found] + [np.zeros(0, np.int64)])
        length = np.concatenate([np.full(hits.shape[0], k, np.int64) for hits, k in found] + [np.zeros(0, np.int64)])
        order = np.argsort(start, kind="stable")
        self.start, self.length = start[order], length[order]
        self.m = m = self.start.shape[0]
        is_space = _is_space(codes) if m else np.zeros(n, dtype=bool)
        arg_space = is_space if any_space else (codes == 32) | (codes == 9) | (codes == 10)
        self.arg = arg = _skip(arg_space, self.start + self.length)
        self.braced = braced = np.zeros(m, dtype=bool)
        inside = arg < n
        ch = codes[arg[inside]]
        braced[inside] = ch == _OPEN
        self.close = shut = pair_braces(codes)[arg] if m else np.zeros(0, np.int64)
        closed = shut >= 0
        self.lo = lo = _skip(is_space, np.where(closed, arg + 1, n))
        self.hi = np.where(closed, _back(is_space, np.where(closed, shut, 0), lo), lo)
        self.after = _skip(is_space, np.where(closed, shut + 1, n))
        self.stop = _skip(~(is_space | (codes == _DOLLAR)), arg)
        self.alpha = alpha = np.zeros(m, dtype=bool)
        letter = ((ch | 32) >= ord("a")) & ((ch | 32) <= ord("z"))
        wide = np.flatnonzero(ch >= 128)
        if wide.size:  # non-ASCII: ask Python, one character per command
            where = np.flatnonzero(inside)[wide]
            letter[wide] = [text[i].isalpha() for i in arg[where].tolist()]
        alpha[inside] = letter & (arg[inside] == self.start[inside] + self.length[inside])
        self._punct = (codes == ord(".")) | (codes == ord(",")) | (codes == ord(";")) if m else None
        # brace-less token read to the end of the text: its content ends at token_hi (.,; dropped)
        self.token_hi = self._rstrip(self.stop, arg) if m else np.zeros(0, np.int64)

    def _rstrip(self, end: np.ndarray, floor: np.ndarray) -> np.ndarray:
        """1 + the last index < end whose character is not one of ``.,;`` (at least floor)."""
        return _back(self._punct, end, floor)

    def outermost(self) -> list[tuple[int, int, int]]:
        """(command index, content lo, content hi) of every outermost box, in text order; braced
        contents are stripped of whitespace, brace-less ones of trailing ``.,;``."""
        out, resume, braceless = [], 0, self.braceless
        start, braced, close = self.start.tolist(), self.braced.tolist(), self.close.tolist()
        lo, hi = self.lo.tolist(), self.hi.tolist()
        if braceless:  # a brace-less box: an argument, no letter right after the name, a token left
            bare = ((self.arg < self.n) & ~self.alpha & (self.token_hi > self.arg)).tolist()
            arg, token_hi, stop = self.arg.tolist(), self.token_hi.tolist(), self.stop.tolist()
        for t, s in enumerate(start):
            if s < resume:
                continue  # inside the previous box
            if braced[t]:
                if close[t] >= 0:
                    out.append((t, lo[t], hi[t]))
                    resume = close[t] + 1
            elif braceless and bare[t]:
                out.append((t, arg[t], token_hi[t]))
                resume = stop[t]
        return out

    def unwrap(self, t0: int, lo: int, hi: int) -> tuple[int, int]:
        """Strip boxes whose argument is the whole remaining content (``\\boxed{\\boxed{5}}`` -> 5),
        starting inside box ``t0`` whose stripped content is [lo, hi).

        The box inside box t, if any, is command t + 1 (only t's name, spaces and brace lie between
        them), so the chain is a run of consecutive commands: every link t -> t + 1 is tested at
        once, with the region end H_t each level has (a braced level's own ``hi``; a brace-less
        level keeps its parent's end, minus trailing ``.,;``), and the first failing link ends it."""
        if t0 + 1 >= self.m or self.start[t0 + 1] != lo:
            return lo, hi
        sl = slice(t0, self.m)
        start, arg, braced = self.start[sl], self.arg[sl], self.braced[sl]
        k = np.arange(start.shape[0])
        # H of the nearest braced level at or above each level (the box t0 counts as one: its region)
        top = np.maximum.accumulate(np.where(braced | (k == 0), k, 0))
        h_top = np.where(top == 0, hi, self.hi[sl][top])
        bound = np.where(braced, self.hi[sl], self._rstrip(h_top, arg))  # H_t for t > t0
        bound[0] = hi
        lo_t = np.where(braced, self.lo[sl], arg)  # where level t's content starts
        lo_t[0] = lo
        parent, child = slice(0, -1), slice(1, None)
        h = bound[parent]
        inner = arg[child]
        ok_braced = (braced[child] & (self.close[sl][child] >= 0) & (self.close[sl][child] < h)
                     & (self.after[sl][child] >= h))
        ok_bare = (~braced[child] & ~self.alpha[sl][child] & (self.stop[sl][child] >= h)
                   & (self._rstrip(h, inner) > inner)) if self.braceless else False
        link = (start[child] == lo_t[parent]) & (inner < h) & (ok_braced | ok_bare)
        broken = np.flatnonzero(~link)
        last = int(broken[0]) if broken.size else link.shape[0]  # levels t0 .. t0 + last hold
        if last == 0:
            return lo, hi
        return int(lo_t[last]), int(bound[last])


def find_boxes(text: str) -> list[str]:
    """Contents of all outermost box commands, in order of appearance."""
    return [text[lo:hi] for _, lo, hi in unstripped_boxes(BoxScan(text))]


def unstripped_boxes(scan: BoxScan) -> list[tuple[int, int, int]]:
    """Outermost boxes with their unstripped braced contents (find_boxes returns them as written)."""
    out = []
    for t, lo, hi in scan.outermost():
        if scan.braced[t]:
            lo, hi = int(scan.arg[t]) + 1, int(scan.close[t])
        out.append((t, lo, hi))
    return out


def extract_answer(response: str) -> str | None:
    """Content of the last ``\\boxed{}`` (or ``\\fbox{}``) of ``response``; None if there is none.

    A box whose whole content is another box is unwrapped (``\\boxed{\\boxed{5}}`` -> ``5``).
    """
    found = _scan_boxes(response)
    if found is None:
        return None
    scan, boxes = found
    lo, hi = scan.unwrap(*boxes[-1])
    return response[lo:hi]


def _scan_boxes(response: str) -> tuple[BoxScan, list] | None:
    """The scan of ``response`` and its outermost boxes; None if it has no box."""
    if not isinstance(response, str):
        raise TypeError(f"response must be str, got {type(response).__name__}")
    if "\\" not in response:
        return None
    scan = BoxScan(response)
    boxes = scan.outermost()
    return (scan, boxes) if boxes else None


# What may sit between two boxes that together are the final answer: spacing, math delimiters,
# ``,;/|&`` and connectives ("\\boxed{1} or \\boxed{2}", "$\\boxed{1}$, $\\boxed{2}$", "\\boxed{1} \\quad
# \\boxed{2}"). A gap with any other word or a sentence end ("... \\boxed{1}. Wait, it is \\boxed{2}")
# keeps the last box alone: the model moved on. Each alternative starts with a distinct kind of
# character, so the match is linear; gaps are also capped in length.
_CONNECTIVES = ("or|and|maybe|perhaps|possibly|either|also|both|o|y|u|e|ou|et|oder|und|ili|"
                "или|и|或|或者|和|及|と|または")
_JOINER = re.compile(r"(?:\s|[$,;/|&~{}()]|\\[ ,;:!()\[\]]|\\\\|\\(?:quad|qquad|text|textbf|textrm|mathrm|mbox|"
                     r"lor|vee)(?![a-zA-Z])|(?<!\w)(?:" + _CONNECTIVES + r")(?!\w))*")
_MAX_GAP = 64


def final_answer(response: str) -> str | None:
    """The answer a response gives: ``final_answers`` with exact repeats dropped, joined by ", "
    when several different ones remain (compared as a list); None if there is no box."""
    answers = final_answers(response)
    if answers is None:
        return None
    distinct = list(dict.fromkeys(a for a in answers if a))  # an empty box adds no value
    return distinct[0] if len(distinct) == 1 else ", ".join(distinct)


def final_answers(response: str) -> list[str] | None:
    """The boxes that make up the final answer: the last box and the boxes before it that are
    joined to it by connectives only (``\\boxed{1} or \\boxed{2}``), in order, each unwrapped and
    stripped; None if there is no box.

    Several boxes offered together are one answer listing several values, so a hedge
    (``\\boxed{1} or \\boxed{2}``, every choice boxed in turn) is graded as that list, never as its last
    item; an answer split over boxes (``\\boxed{x=1}, \\boxed{y=2}``) is graded whole."""
    found = _scan_boxes(response)
    if found is None:
        return None
    scan, boxes = found
    k = len(boxes) - 1
    while k > 0:
        gap_lo = _box_end(scan, boxes[k - 1])
        gap_hi = int(scan.start[boxes[k][0]])
        if gap_hi - gap_lo > _MAX_GAP or not _JOINER.fullmatch(response, gap_lo, gap_hi):
            break
        k -= 1
    return [response[lo:hi] for lo, hi in (scan.unwrap(*box) for box in boxes[k:])]


def _box_end(scan: BoxScan, box: tuple[int, int, int]) -> int:
    """Index just after box ``box`` (an entry of ``outermost``): its closing brace or its token."""
    t, _, hi = box
    return int(scan.close[t]) + 1 if scan.braced[t] else hi
