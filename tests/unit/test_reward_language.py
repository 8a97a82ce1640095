"""fastText language ID and the consistency policy, on the hand-written multilingual set."""
from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

from megatron_rl.reward import language as L

DATA = Path(__file__).resolve().parents[1] / "data" / "language_id.jsonl"
ITEMS = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
MONO = [d for d in ITEMS if d["lang"] not in ("mixed", "und")]
LANGS = ("en", "fr", "es", "de", "it", "ru", "zh", "ja")


def test_model_ships_in_the_wheel():
    assert os.path.isfile(L.model_path()) and L.model_path().endswith("lid.176.ftz")


def test_dataset_covers_required_languages():
    counts = collections.Counter(d["lang"] for d in ITEMS)
    for lang in LANGS:
        assert counts[lang] >= 8, lang
    assert counts["mixed"] >= 8 and counts["und"] >= 5


def test_detect_accuracy_per_language():
    hits = collections.defaultdict(list)
    for d in MONO:
        hits[d["lang"]].append(L.detect(d["text"])[0] == d["lang"])
    overall = sum(sum(v) for v in hits.values()) / len(MONO)
    assert overall >= 0.95, dict(hits)
    for lang, v in hits.items():
        assert sum(v) / len(v) >= 0.85, (lang, v)


def test_single_language_texts_are_not_flagged_mixed():
    flagged = [d["text"][:40] for d in MONO if L.profile(d["text"]).mixed]
    assert not flagged


def test_code_switching_is_flagged_mixed():
    mixed = [d for d in ITEMS if d["lang"] == "mixed"]
    missed = [d["text"][:40] for d in mixed if not L.profile(d["text"]).mixed]
    assert len(missed) <= 1, missed


def test_math_and_code_only_texts_abstain():
    for d in (d for d in ITEMS if d["lang"] == "und"):
        assert L.profile(d["text"]).language is None, d["text"]
    assert L.detect("$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$") == (L.UNDETERMINED, 0.0)


def test_clean_removes_latex_code_and_numbers():
    text = ("Let $x^2 + 1 = 5$ and \\[ y = \\frac{3}{4} \\] so \\boxed{42}. Code:\n```python\nprint(123)\n```\n"
            "Use `len(s)` here, see https://example.com/a1 for 2024 details.")
    out = L.clean(text)
    for banned in ("$", "frac", "boxed", "print", "len", "http", "example", "\\"):
        assert banned not in out, (banned, out)
    assert not any(c.isdigit() for c in out)
    assert "Let" in out and "details" in out


def test_zh_without_kana_is_not_ja():
    assert L.detect("答案是五")[0] == "zh"
    assert L.detect("答えは五です")[0] == "ja"


def _text(lang, kind):
    return next(d["text"] for d in ITEMS if d["lang"] == lang and d["kind"] == kind)


@pytest.mark.parametrize("lang", LANGS)
def test_consistent_when_all_parts_share_the_language(lang):
    problem = _text(lang, "prose")
    assert L.is_consistent(problem, _text(lang, "reasoning"), _text(lang, "short"))


def test_inconsistent_when_thoughts_or_answer_change_language():
    assert not L.is_consistent(_text("en", "prose"), _text("fr", "reasoning"), _text("en", "short"))
    assert not L.is_consistent(_text("zh", "prose"), _text("zh", "reasoning"), _text("en", "reasoning"))
    assert not L.is_consistent(_text("de", "prose"), _text("ru", "reasoning"), _text("ru", "short"))
    # a short answer sentence in another language is enough
    assert not L.is_consistent(_text("en", "prose"), _text("en", "reasoning"), "Donc la réponse est $\\boxed{3}$.")


def test_mixed_thoughts_are_inconsistent_even_if_the_majority_matches():
    thoughts = _text("en", "reasoning") + " " + next(d["text"] for d in ITEMS if d["lang"] == "mixed")
    ok, details = L.check_consistency(_text("en", "prose"), thoughts, "The answer is $\\boxed{3}$.")
    assert not ok and details["mixed"] == ["thoughts"]


def test_math_only_parts_abstain_instead_of_failing():
    # bare box answer, LaTeX-only thoughts: not penalised
    assert L.is_consistent(_text("fr", "prose"), _text("fr", "reasoning"), "$\\boxed{4}$")
    assert L.is_consistent("Compute $2+2$.", "$2+2=4$", "\\boxed{4}")
    assert L.is_consistent("", "$x=1$", "\\boxed{1}")
    # no problem text: thoughts and answer are still compared
    assert not L.is_consistent("", _text("es", "reasoning"), _text("it", "reasoning"))


def test_single_foreign_words_are_tolerated_but_phrases_are_not():
    zh = "我们用 Python 写代码。首先读取输入，然后计算两个数的和，最后输出结果。注意输入可能有多行，需要逐行处理。"
    assert not L.profile(zh).mixed
    assert L.profile(zh.replace("最后输出结果", "and finally we print the result")).mixed
