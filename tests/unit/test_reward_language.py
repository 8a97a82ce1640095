"""fastText language ID and the per-window consistency policy, on hand-written multilingual sets.

tests/data/language_id.jsonl: single texts (one language, code-switched, or math/code only).
tests/data/language_consistency.jsonl: (problem, thoughts, answer) triples labelled consistent or
switch; the labels are facts about the languages written there, not outputs of this code.
"""
from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import pytest

from megatron_rl.config import RewardConfig
from megatron_rl.reward import language as L
from megatron_rl.reward import score

DATA = Path(__file__).resolve().parents[1] / "data"
ITEMS = [json.loads(line) for line in (DATA / "language_id.jsonl").read_text(encoding="utf-8").splitlines()
         if line.strip()]
MONO = [d for d in ITEMS if d["lang"] not in ("mixed", "und")]
LANGS = ("en", "fr", "es", "de", "it", "ru", "zh", "ja")
TRIPLES = [json.loads(line) for line in
           (DATA / "language_consistency.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
BY_ID = {d["id"]: d for d in TRIPLES}


def test_model_ships_in_the_wheel():
    assert os.path.isfile(L.model_path()) and L.model_path().endswith("lid.176.ftz")


def test_datasets_cover_required_languages():
    counts = collections.Counter(d["lang"] for d in ITEMS)
    for lang in LANGS:
        assert counts[lang] >= 8, lang
    assert counts["mixed"] >= 8 and counts["und"] >= 5
    langs = collections.Counter(d["lang"] for d in TRIPLES)
    kinds = collections.Counter(d["kind"] for d in TRIPLES if d["label"] == "switch")
    for lang in ("en", "fr", "de", "es", "it", "pt", "ru", "zh", "ja", "ar"):
        assert langs[lang] >= 6, lang
    for kind in ("mid_sentence", "mid_thoughts", "answer"):
        assert kinds[kind] >= 8, kind


def test_detect_accuracy_per_language():
    hits = collections.defaultdict(list)
    for d in MONO:
        hits[d["lang"]].append(L.detect(d["text"])[0] == d["lang"])
    overall = sum(sum(v) for v in hits.values()) / len(MONO)
    assert overall >= 0.95, dict(hits)
    for lang, v in hits.items():
        assert sum(v) / len(v) >= 0.85, (lang, v)


def test_single_language_texts_are_not_flagged_mixed():
    assert not [d["text"][:40] for d in MONO if L.profile(d["text"]).mixed]


def test_code_switching_is_flagged_mixed():
    missed = [d["text"][:40] for d in ITEMS if d["lang"] == "mixed" and not L.profile(d["text"]).mixed]
    assert len(missed) <= 1, missed


def test_math_and_code_only_texts_abstain():
    for d in (d for d in ITEMS if d["lang"] == "und"):
        assert L.profile(d["text"]).language is None, d["text"]
    assert L.detect("$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$") == (L.UNDETERMINED, 0.0)


def test_clean_removes_latex_code_numbers_and_variables():
    text = ("Let $x^2 + 1 = 5$ and \\[ y = \\frac{3}{4} \\] so \\boxed{42}. Code:\n```python\nprint(123)\n```\n"
            "Use `len(s)` here, see https://example.com/a1 for 2024 details, with x y z > 0.")
    out = L.clean(text)
    for banned in ("$", "frac", "boxed", "print", "len", "http", "example", "\\", " x ", " y "):
        assert banned not in f" {out} ", (banned, out)
    assert not any(c.isdigit() for c in out)
    assert "Let" in out and "details" in out


def test_unclosed_delimiters_do_not_swallow_the_text():
    # a price, a lone "\[" and an unclosed environment are text, not math running to the end
    out = L.clean("It costs $5 today \\[ and the bakery \\begin{align} closes at noon")
    assert "bakery" in out and "closes at noon" in out
    # an unclosed code fence is code to the end (a truncated response)
    assert L.clean("Here it is:\n```python\nprint('hello world')") == "Here it is"


def test_zh_without_kana_is_not_ja():
    assert L.detect("答案是五")[0] == "zh"
    assert L.detect("答えは五です")[0] == "ja"


def _text(lang, kind):
    return next(d["text"] for d in ITEMS if d["lang"] == lang and d["kind"] == kind)


@pytest.mark.parametrize("lang", LANGS)
def test_consistent_when_all_parts_share_the_language(lang):
    assert L.is_consistent(_text(lang, "prose"), _text(lang, "reasoning"), _text(lang, "short"))


def test_inconsistent_when_thoughts_or_answer_change_language():
    assert not L.is_consistent(_text("en", "prose"), _text("fr", "reasoning"), _text("en", "short"))
    assert not L.is_consistent(_text("zh", "prose"), _text("zh", "reasoning"), _text("en", "reasoning"))
    assert not L.is_consistent(_text("de", "prose"), _text("ru", "reasoning"), _text("ru", "short"))
    # a short answer sentence in another language is enough
    assert not L.is_consistent(_text("en", "prose"), _text("en", "reasoning"), "Donc la réponse est $\\boxed{3}$.")


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


# ------------------------------------------------------------------ per-window judging

# Switches inside a sentence or a minority sentence: every part's majority is still the problem's
# language, so classifying each part whole (detect) sees three parts in one language.
HIDDEN_SWITCHES = [
    ("fr", "Un carré a un côté de 7 cm. Quelle est son aire ?",
     "L'aire d'un carré est le côté multiplié par lui-même, donc $A = c^2$. Avec un côté de 7, "
     "we simply square the side length to get the area of the square. On obtient $7^2 = 49$.",
     "L'aire du carré est de $\\boxed{49}$ cm²."),
    ("de", "Ein Quadrat hat eine Seitenlänge von 7 cm. Wie groß ist seine Fläche?",
     "Die Fläche eines Quadrats ist die Seitenlänge mal sich selbst, also $A = a^2$. Wir setzen die "
     "Seitenlänge ein, and then the area is just seven times seven, nothing more. Das ergibt $49$.",
     "Die Fläche beträgt $\\boxed{49}$ cm²."),
    ("en", "A square has a side of 7 cm. What is its area?",
     "The area of a square is the side times itself, so $A = s^2$. We plug in the side length of seven "
     "centimetres and compute the square of that number carefully. Attendez, je dois vérifier que "
     "l'unité est bien le centimètre carré. The result is $7^2 = 49$ square centimetres, which is the "
     "area we were asked for in the problem statement.",
     "The area is $\\boxed{49}$ square centimetres."),
]


@pytest.mark.parametrize("lang,problem,thoughts,answer", HIDDEN_SWITCHES, ids=[h[0] for h in HIDDEN_SWITCHES])
def test_per_window_catches_switches_a_whole_part_vote_misses(lang, problem, thoughts, answer):
    assert {L.detect(problem)[0], L.detect(thoughts)[0], L.detect(answer)[0]} == {lang}
    ok, details = L.check_consistency(problem, thoughts, answer)
    assert not ok and details["reference"] == lang and "thoughts" in details["switch"], details


def test_labelled_set_agreement():
    wrong = [d["id"] for d in TRIPLES
             if L.is_consistent(d["problem"], d["thoughts"], d["answer"]) != (d["label"] == "consistent")]
    # known miss: es -> pt in the answer (close relatives need lid.176 at >= 0.95)
    assert len(wrong) <= 2 and len(wrong) / len(TRIPLES) <= 0.05, wrong


@pytest.mark.parametrize("kind", ["mid_sentence", "mid_thoughts", "mid_thoughts_long"])
def test_every_mid_response_switch_is_caught(kind):
    missed = [d["id"] for d in TRIPLES if d["kind"] == kind
              and L.is_consistent(d["problem"], d["thoughts"], d["answer"])]
    assert not missed


def test_consistent_multilingual_texts_with_formulas_stay_consistent():
    flagged = [(d["id"], L.check_consistency(d["problem"], d["thoughts"], d["answer"])[1]) for d in TRIPLES
               if d["label"] == "consistent" and not L.is_consistent(d["problem"], d["thoughts"], d["answer"])]
    assert not flagged
    assert len({d["lang"] for d in TRIPLES if d["label"] == "consistent"}) == 10


def test_weak_problem_defers_to_the_response():
    # "Factorize x^3+y^3+z^3-3xyz." has one word of prose; lid.176 calls "Factorize" Spanish.
    problem = "Factorize x^3+y^3+z^3-3xyz."
    thoughts = ("This is a classic identity. The expression equals the product of the sum of the three "
                "variables and the sum of their squares minus their pairwise products.")
    assert L.is_consistent(problem, thoughts, "The factorisation is $(x+y+z)(x^2+y^2+z^2-xy-yz-zx)$.")


def test_window_cap_samples_the_whole_part():
    sentence = "The derivative of the function is positive on the whole interval. "
    policy = L.LanguagePolicy(max_windows=8)
    prof = L.profile(sentence * 50 + "Mais la dérivée de la fonction change de signe au milieu.", policy)
    assert len(prof.windows) == 8 and prof.language == "en"
    full = L.profile(sentence * 50)
    assert len(full.windows) == 50


def test_config_window_changes_the_grade():
    problem = "Un rectangle a un périmètre de 30 cm et une longueur de 9 cm. Quelle est son aire ?"
    # one clause (no comma) that turns English half-way: only a window shorter than it sees that
    thoughts = ("Le périmètre vaut $2(L + l) = 30$ donc $L + l = 15$. Comme la longueur est égale à neuf "
                "centimètres la largeur vaut six centimètres and then we simply multiply the length by the "
                "width to get the area. On obtient $9 \\times 6 = 54$.")
    task = {"kind": "math", "answer": "54", "problem": problem}
    response = f"<think>{thoughts}</think>\nL'aire du rectangle est $\\boxed{{54}}$."
    assert RewardConfig().language_window_letters == 60
    default = score(task, response, RewardConfig(), num_tokens=50)
    assert default.correct and not default.language_ok and "thoughts" in default.details["language"]["switch"]
    # one window per clause: the French majority of the clause wins
    whole = score(task, response, RewardConfig(language_window_letters=1000), num_tokens=50)
    assert whole.correct and whole.language_ok
    assert L.policy_for(5).min_window_letters == 5  # any size >= 1 is a valid policy


# ------------------------------------------------------------------ hostile inputs

HOSTILE = {
    "no punctuation": "the derivative of the function is positive " * 24_000,
    "one giant word": "a" * (1 << 20),
    "unclosed brackets": "\\[ ab " * 170_000,
    "unclosed environments": "".join(f"\\begin{{env{'x' * (k % 30)}}} word " for k in range(40_000)),
    "lone dollars and ticks": "$ ` word " * 110_000,
    "chinese without punctuation": "我们先计算这个函数的导数然后令它等于零" * 55_000,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_megabyte_inputs_finish(name):
    text = HOSTILE[name]
    assert len(text) >= 900_000
    start = time.perf_counter()
    ok = L.is_consistent("Compute the value of the expression.", text, "The answer is three.")
    # linear work: ~1-2 s here; the bound only catches quadratic blow-ups (the old regexes took
    # 14 s on 64 KB of unclosed "\[")
    assert time.perf_counter() - start < 60
    assert isinstance(ok, bool)
    assert len(L.profile(text).windows) <= L.DEFAULT_POLICY.max_windows


def test_english_clauses_with_french_looking_words_stay_english():
    # lid.176 calls the first clause French (pour, contents); its English function words overrule it
    problem = "You have two jugs of 3 and 5 litres. How do you measure exactly 4 litres of water?"
    thoughts = ("To pour the contents of Jug A into Jug B, we first fill Jug A from the tap. To fill Jug B "
                "you fill it completely and then pour it into Jug A until Jug A is full. Then we empty Jug A "
                "and pour the remaining water of Jug B into it.")
    assert L.is_consistent(problem, thoughts, "Six pours are enough, so the answer is $\\boxed{6}$.")


def test_a_clause_called_an_impossible_language_abstains():
    # lid.176 gives the Chinese clause "方程两边同时减去" (subtract from both sides) Catalan at 0.86
    prof = L.profile("我们来一步一步地思考。方程 $2x + 5 = 13$ 两边同时减去 $5$，得到 $2x = 8$。")
    assert prof.language == "zh" and not prof.mixed
    assert all(w.lang in ("zh", L.UNDETERMINED) for w in prof.windows)
