"""Language consistency: the whole-chunk check (before) vs the per-window check (now).

Data: tests/data/language_consistency.jsonl, hand-written (problem, thoughts, answer) triples in
en, fr, de, es, it, pt, ru, zh, ja, ar, labelled `consistent` (math, LaTeX, code, loanwords, names,
short sentences) or `switch` (mid-sentence, mid-thoughts, long thoughts with one foreign sentence,
answer only, whole response). Prints, for both methods on the same items in one run:
- agreement with the labels, overall and per kind; switches caught; consistent items flagged;
- time per response (mean over --reps passes) and the ratio new / old;
- false alarms on real English text, all consistent: CHAMP's 270 competition solutions (math
  prose) and 600 reasoning-gym questions of 20 prose-heavy tasks (jugs, zebra puzzles, ...);
- time on a hostile response (unclosed "\\[" repeated), where the old regexes are quadratic.

The baseline below is a copy of megatron_rl.reward.language as it was before per-window judging:
sentences grouped into chunks of >= 24 letters, each chunk classified, a part is "mixed" when its
top language holds < 80% of the confident letters or foreign-script phrases > 8% of the letters.

    .venv/bin/python benchmarks/language_consistency.py [--verbose] [--reps N] [--skip-english]
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import time
import unicodedata
from pathlib import Path

from megatron_rl.reward import language as L

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "language_consistency.jsonl"


# ------------------------------------------------------------------ baseline: whole-chunk (copy)

class Baseline:
    CODE_FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)
    INLINE_CODE = re.compile(r"`[^`\n]*`")
    MATH = re.compile(r"\$\$.*?\$\$|\\\[.*?\\\]|\\\(.*?\\\)|\\begin\{([^}]*)\}.*?\\end\{\1\}"
                      r"|\$(?:\\.|[^$\\]){1,2000}?\$", re.S)
    URL = re.compile(r"https?://\S+|www\.\S+")
    THINK = re.compile(r"</?think>")
    COMMAND = re.compile(r"\\[A-Za-z]+\*?")
    SENTENCE = re.compile(r"[.!?;:\n。！？；：…]+")
    NON_WORD = re.compile(r"[\d=+*/^_<>|~\\{}\[\]()#$%&@`\"“”«»„,，、·•\u2010-\u2015\u2212-]+")
    MIN_LETTERS, CHUNK, MIN_CONF, DOMINANCE, SCRIPT_TOL, CJK = 8, 24, 0.4, 0.8, 0.08, 3

    @classmethod
    def strip(cls, text):
        text = cls.INLINE_CODE.sub(" ", cls.CODE_FENCE.sub("\n", text))
        text = cls.THINK.sub("\n", cls.URL.sub(" ", cls.MATH.sub(" ", text)))
        return cls.COMMAND.sub(" ", text)

    @classmethod
    def words(cls, sentence):
        return [w.strip("'’-") for w in cls.NON_WORD.sub(" ", sentence).split() if w.strip("'’-")]

    @staticmethod
    def script(ch):
        if ch.isascii():
            return "latin"
        name = unicodedata.name(ch, "")
        if name.split(" ", 1)[0] in ("CJK", "HIRAGANA", "KATAKANA") or "IDEOGRAPH" in name:
            return "cjk"
        return name.split(" ", 1)[0].lower() or "other"

    @classmethod
    def weights(cls, words):
        out = {}
        for w in words:
            letters = [c for c in w if c.isalpha()]
            if len(letters) < 2 and not any(cls.script(c) == "cjk" for c in letters):
                continue
            for c in letters:
                s = cls.script(c)
                out[s] = out.get(s, 0) + (cls.CJK if s == "cjk" else 1)
        return out

    @classmethod
    def runs(cls, words):
        runs = []
        for w in words:
            wt = cls.weights([w])
            if not wt:
                continue
            s = max(wt, key=wt.get)
            k = sum(c.isalpha() for c in w) if s == "cjk" else 1
            if runs and runs[-1][0] == s:
                runs[-1][1] += k
                runs[-1][2] += sum(wt.values())
            else:
                runs.append([s, k, sum(wt.values())])
        return runs

    @classmethod
    def profile(cls, text):
        """(language or None, mixed)."""
        chunks, buf, buf_w, runs = [], [], {}, []
        for sentence in cls.SENTENCE.split(cls.strip(text)):
            words = cls.words(sentence)
            if not words:
                continue
            buf.append(" ".join(words))
            for s, n in cls.weights(words).items():
                buf_w[s] = buf_w.get(s, 0) + n
            runs.extend(cls.runs(words))
            if sum(buf_w.values()) >= cls.CHUNK:
                chunks.append((". ".join(buf), buf_w))
                buf, buf_w = [], {}
        if buf:  # a short tail joins the previous chunk
            if chunks:
                t, w = chunks.pop()
                merged = dict(w)
                for s, n in buf_w.items():
                    merged[s] = merged.get(s, 0) + n
                chunks.append((t + ". " + ". ".join(buf), merged))
            else:
                chunks.append((". ".join(buf), buf_w))
        scripts = {}
        for _, w in chunks:
            for s, n in w.items():
                scripts[s] = scripts.get(s, 0) + n
        letters = sum(scripts.values())
        main = max(scripts, key=scripts.get) if scripts else "latin"
        foreign = sum(n for s, k, n in runs if s != main and k >= 2) / letters if letters else 0.0
        if letters < cls.MIN_LETTERS:
            return None, False
        per_lang = {}
        for t, w in chunks:
            n = sum(w.values())
            if n:
                lang, p = L._classify(t)
                if p >= cls.MIN_CONF:
                    per_lang[lang] = per_lang.get(lang, 0) + n
        if not per_lang:
            return None, foreign > cls.SCRIPT_TOL
        top = max(per_lang, key=per_lang.get)
        share = per_lang[top] / sum(per_lang.values())
        return top, share < cls.DOMINANCE or foreign > cls.SCRIPT_TOL

    @classmethod
    def is_consistent(cls, problem, thoughts, answer):
        parts = [cls.profile(problem or ""), cls.profile(thoughts), cls.profile(answer)]
        if parts[1][1] or parts[2][1]:
            return False
        return len({lang for lang, _ in parts if lang is not None}) <= 1


# ------------------------------------------------------------------ measurement

def _new(problem, thoughts, answer):
    return L.is_consistent(problem, thoughts, answer)


METHODS = {"whole-chunk (old)": Baseline.is_consistent, "per-window (new)": _new}


def _timed(fn, rows, reps):
    start = time.perf_counter()
    for _ in range(reps):
        for r in rows:
            fn(*r)
    return (time.perf_counter() - start) / (reps * len(rows))


def _champ_rows():
    import champ_dataset

    rows = []
    for p in champ_dataset.load("v0").problems.values():  # math marked @@..@@ there; LaTeX-like $..$ here
        thoughts = " ".join(s._raw_text for s in p.solution.steps).replace("@@", "$")
        rows.append((p.text.replace("@@", "$"), thoughts, f"The answer is $\\boxed{{{p.answer}}}$."))
    return rows


RG_TASKS = ("gsm_symbolic", "family_relationships", "knights_knaves", "syllogism", "zebra_puzzles", "aiw",
            "leg_counting", "time_intervals", "simple_geometry", "course_schedule", "calendar_arithmetic",
            "jugs", "coin_flip", "dice", "quantum_lock", "self_reference", "rotten_oranges", "circuit_logic",
            "advanced_geometry", "polynomial_equations")


def _reasoning_gym_rows():
    import reasoning_gym

    return [("Solve the following problem.", item["question"], "The answer is given above.")
            for task in RG_TASKS for item in reasoning_gym.create_dataset(task, size=30, seed=1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verbose", action="store_true", help="list the items each method gets wrong")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-english", action="store_true", help="skip CHAMP and reasoning-gym")
    args = parser.parse_args()
    items = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [(d["problem"], d["thoughts"], d["answer"]) for d in items]
    L._get_model()

    verdicts = {name: [fn(*r) for r in rows] for name, fn in METHODS.items()}
    print(f"language consistency on {DATA.name}: {len(items)} responses "
          f"({sum(d['label'] == 'switch' for d in items)} switch), "
          f"{len({d['lang'] for d in items})} problem languages")
    names = list(METHODS)
    print(f"{'kind':20s} {'label':10s} {'n':>3s} " + " ".join(f"{n:>18s}" for n in names))
    groups = collections.defaultdict(list)
    for k, d in enumerate(items):
        groups[(d["label"], d["kind"])].append(k)
    for (label, kind), ks in sorted(groups.items()):
        cells = [f"{sum(verdicts[n][k] == (label == 'consistent') for k in ks):>15d}/{len(ks):<2d}" for n in names]
        print(f"{kind:20s} {label:10s} {len(ks):3d} " + " ".join(cells))
    times = {n: _timed(fn, rows, args.reps) for n, fn in METHODS.items()}
    for n in names:
        ok = [v == (d["label"] == "consistent") for v, d in zip(verdicts[n], items)]
        caught = sum(not v for v, d in zip(verdicts[n], items) if d["label"] == "switch")
        false = sum(not v for v, d in zip(verdicts[n], items) if d["label"] == "consistent")
        print(f"{n:18s}: agreement {sum(ok) / len(ok):6.1%} ({sum(ok)}/{len(ok)}), switches caught "
              f"{caught}/{sum(d['label'] == 'switch' for d in items)}, consistent flagged {false}/"
              f"{sum(d['label'] == 'consistent' for d in items)}, {times[n] * 1e3:.2f} ms/response")
        if args.verbose:
            for v, d in zip(verdicts[n], items):
                if v != (d["label"] == "consistent"):
                    print(f"    wrong: {d['id']} ({d['label']})")
    print(f"time ratio new / old: {times[names[1]] / times[names[0]]:.2f}x")

    if not args.skip_english:
        english = (("CHAMP solutions", _champ_rows()), ("reasoning-gym questions", _reasoning_gym_rows()))
        for name, rows_en in english:
            flagged = {n: sum(not fn(*r) for r in rows_en) for n, fn in METHODS.items()}
            print(f"{name} ({len(rows_en)} English texts, all consistent) flagged: "
                  + ", ".join(f"{n} {k}" for n, k in flagged.items()))

    for size in (16_384, 65_536):  # unclosed "\[": the old lazy regex rescans to the end each time
        hostile = "\\[ ab" * (size // 5)
        cells = []
        for n, fn in METHODS.items():
            start = time.perf_counter()
            fn("Compute the value.", hostile, "The answer is three.")
            cells.append(f"{n} {time.perf_counter() - start:.2f} s")
        print(f"hostile {size // 1024} KB of unclosed '\\[': " + ", ".join(cells))
    start = time.perf_counter()
    _new("Compute the value.", "\\[ ab" * ((1 << 20) // 5), "The answer is three.")
    print(f"hostile 1 MB of unclosed '\\[': per-window (new) {time.perf_counter() - start:.2f} s "
          f"(old not run: quadratic)")


if __name__ == "__main__":
    main()
