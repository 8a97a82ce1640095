"""Answer scanning on hostile responses: the old per-box rescans vs math.extract.BoxScan.

For each adversarial shape, times ``extract_answer`` (last box, math.extract), the format gate's
box check (format.has_nonempty_box) and the code tasks' fenced-block scan (format.fenced_blocks,
the old one a lazy regex) against the old-style scans, which look for each box's closing
brace by rescanning the rest of the text (quadratic). The old scans run on a small size (they take
tens of seconds at 100 KB); the new ones on the same size (the ratio, same run) and on 1 MB (the
issue's bound: < 0.2 s each; best of 3 runs, as the machine is shared). Old and new must agree.

    .venv/bin/python benchmarks/answer_scan.py [--small-kb 16] [--big-kb 1024]
"""
from __future__ import annotations

import argparse
import re
import sys
import time

from megatron_rl.reward.format import LANGUAGE_TAGS, fenced_blocks, has_nonempty_box
from megatron_rl.reward.math.extract import extract_answer

# ---- the old-style baseline (the scans this project used before BoxScan), kept here to measure it


def _old_match(text: str, i: int) -> int | None:
    depth = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        depth += (ch == "{") - (ch == "}")
        if ch == "}" and depth == 0:
            return i
        i += 1
    return None


def _old_box_at(text: str, j: int):
    for cmd in ("\\boxed", "\\fbox"):
        if text.startswith(cmd, j):
            i = j + len(cmd)
            while i < len(text) and text[i] in " \t\n":
                i += 1
            if i >= len(text):
                return None
            if text[i] == "{":
                close = _old_match(text, i)
                return None if close is None else (text[i + 1:close], close + 1)
            if i == j + len(cmd) and text[i].isalpha():
                return None
            k = i
            while k < len(text) and not text[k].isspace() and text[k] != "$":
                k += 1
            token = text[i:k].rstrip(".,;")
            return (token, k) if token else None
    return None


def old_extract(text: str) -> str | None:
    boxes, i = [], 0
    while (j := text.find("\\", i)) >= 0:
        parsed = _old_box_at(text, j)
        if parsed is None:
            i = j + 1
        else:
            boxes.append(parsed[0])
            i = parsed[1]
    if not boxes:
        return None
    answer = boxes[-1].strip()
    while (parsed := _old_box_at(answer, 0)) is not None and not answer[parsed[1]:].strip():
        answer = parsed[0].strip()
    return answer


_BOXED = re.compile(r"\\boxed\s*\{")


def old_gate(text: str) -> bool:
    for m in _BOXED.finditer(text):
        close = _old_match(text, m.end() - 1)
        if close is not None and text[m.end():close].strip():
            return True
    return False


_FENCE = re.compile(r"^[ \t]*```[ \t]*([^\s`]*)[^\n]*\n(.*?)\n[ \t]*```[ \t]*$", re.M | re.S)


def old_fences(text: str) -> list[tuple[str, str]]:
    """The old lazy-regex fenced-block scan (code tasks): rescans to the end per unclosed fence."""
    return [(LANGUAGE_TAGS.get(m.group(1).lower(), m.group(1).lower()), m.group(2)) for m in _FENCE.finditer(text)]


FENCE_SHAPES = {
    "unclosed ```python fences": lambda n: _repeat("```python\nprint(1)\n", n),
    "closed ``` blocks": lambda n: _repeat("```\n", n),
}

# ---- shapes: each a function of a size in characters


def _repeat(unit: str, size: int, tail: str = "") -> str:
    return unit * max(1, size // len(unit)) + tail


SHAPES = {
    "unclosed 'The answer is \\boxed{'": lambda n: _repeat("The answer is \\boxed{", n),
    "nested \\boxed{\\boxed{...}}": lambda n: "\\boxed{" * (n // 8) + "42" + "}" * (n // 8),
    "deep {{{{ in a box": lambda n: "\\boxed{" + "{" * (n // 2) + "1" + "}" * (n // 2) + "}",
    "deep unclosed {{{{ after boxes": lambda n: _repeat("\\boxed{1} {", n),
    "many closed boxes": lambda n: _repeat("\\boxed{12} ", n),
    "\\fbox unclosed": lambda n: _repeat("\\fbox{", n, "\\fbox{7}"),
    "unbalanced }": lambda n: _repeat("}", n, "\\boxed{3}") + _repeat("}\\boxed{", n // 4),
    "escaped \\{ in one box": lambda n: "\\boxed{" + _repeat("\\{", n) + "}",
    "brace-less chain \\boxed\\boxed..": lambda n: _repeat("\\boxed", n, "{9}"),
    "many brace-less \\boxed 5": lambda n: _repeat("\\boxed 5. ", n),
}


def _time(fn, text: str, repeat: int = 1) -> tuple[float, object]:
    """Best of ``repeat`` runs (the machine is shared: the best run is the scan's own cost)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn(text)
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small-kb", type=int, default=16, help="size for the old-vs-new ratio")
    ap.add_argument("--big-kb", type=int, default=1024, help="size for the new scan alone")
    args = ap.parse_args()
    small, big = args.small_kb * 1024, args.big_kb * 1024
    print(f"{'shape':36s} {'what':8s} {'old ' + str(args.small_kb) + 'KB':>10s} {'new':>8s} "
          f"{'ratio':>8s} {'new ' + str(args.big_kb) + 'KB':>10s}")
    worst, ok = 0.0, True
    cases = [(name, make, what, old, new) for name, make in SHAPES.items()
             for what, old, new in (("extract", old_extract, extract_answer), ("gate", old_gate, has_nonempty_box))]
    cases += [(name, make, "fences", old_fences, fenced_blocks) for name, make in FENCE_SHAPES.items()]
    worst_box = 0.0
    for name, make, what, old, new in cases:
        text, huge = make(small), make(big)
        t_old, a = _time(old, text)
        t_new, b = _time(new, text, 3)
        t_big, _ = _time(new, huge, 3)
        ok &= a == b
        worst = max(worst, t_big)
        worst_box = worst_box if what == "fences" else max(worst_box, t_big)
        print(f"{name:36s} {what:8s} {t_old:10.3f} {t_new:8.4f} {t_old / max(t_new, 1e-9):7.0f}x "
              f"{t_big:10.3f}{'' if a == b else '   DISAGREE'}")
    print(f"\nworst new scan at {args.big_kb} KB: boxes {worst_box:.3f} s (bound 0.2 s), all {worst:.3f} s; "
          f"old and new agree: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
