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
import unicodedata
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
    # known miss: es -> pt in the answer (a close relative needs lid.176 at >= 0.9; it gives pt 0.64)
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


# ------------------------------------------------------------------ multilingual probes
# (problem, thoughts, answer), each written in the language of its key: the labels are what a reader
# of the text knows, not outputs of this code.

TRAIN = {
    "en": ("A train travels 120 km in 2 hours. What is its average speed?",
           "The average speed is the distance divided by the time. The distance is 120 km and the time is "
           "2 hours, so the speed is $120/2 = 60$ km/h.",
           "The average speed of the train is $\\boxed{60}$ km/h."),
    "fr": ("Un train parcourt 120 km en 2 heures. Quelle est sa vitesse moyenne ?",
           "La vitesse moyenne est la distance divisée par le temps. La distance est de 120 km et le temps "
           "est de 2 heures, donc la vitesse vaut $120/2 = 60$ km/h.",
           "La vitesse moyenne du train est de $\\boxed{60}$ km/h."),
    "es": ("Un tren recorre 120 km en 2 horas. ¿Cuál es su velocidad media?",
           "La velocidad media es la distancia dividida entre el tiempo. La distancia es de 120 km y el "
           "tiempo es de 2 horas, así que la velocidad es $120/2 = 60$ km/h.",
           "La velocidad media del tren es de $\\boxed{60}$ km/h."),
    "de": ("Ein Zug fährt 120 km in 2 Stunden. Wie hoch ist seine Durchschnittsgeschwindigkeit?",
           "Die Durchschnittsgeschwindigkeit ist die Strecke geteilt durch die Zeit. Die Strecke beträgt "
           "120 km und die Zeit 2 Stunden, also ist die Geschwindigkeit $120/2 = 60$ km/h.",
           "Die Durchschnittsgeschwindigkeit des Zuges beträgt $\\boxed{60}$ km/h."),
    "it": ("Un treno percorre 120 km in 2 ore. Qual è la sua velocità media?",
           "La velocità media è la distanza divisa per il tempo. La distanza è di 120 km e il tempo è di "
           "2 ore, quindi la velocità è $120/2 = 60$ km/h.",
           "La velocità media del treno è di $\\boxed{60}$ km/h."),
    "pt": ("Um trem percorre 120 km em 2 horas. Qual é a sua velocidade média?",
           "A velocidade média é a distância dividida pelo tempo. A distância é de 120 km e o tempo é de "
           "2 horas, então a velocidade é $120/2 = 60$ km/h.",
           "A velocidade média do trem é de $\\boxed{60}$ km/h."),
    "ru": ("Поезд проезжает 120 км за 2 часа. Какова его средняя скорость?",
           "Средняя скорость равна расстоянию, делённому на время. Расстояние равно 120 км, а время 2 часа, "
           "поэтому скорость равна $120/2 = 60$ км/ч.",
           "Средняя скорость поезда равна $\\boxed{60}$ км/ч."),
    "zh": ("一列火车在2小时内行驶了120公里。它的平均速度是多少？",
           "平均速度等于路程除以时间。路程是120公里，时间是2小时，所以速度是 $120/2 = 60$ 公里每小时。",
           "火车的平均速度是 $\\boxed{60}$ 公里每小时。"),
    "zh-Hant": ("一列火車在2小時內行駛了120公里。它的平均速度是多少？",
                "平均速度等於路程除以時間。路程是120公里，時間是2小時，所以速度是 $120/2 = 60$ 公里每小時。",
                "火車的平均速度是 $\\boxed{60}$ 公里每小時。"),
    "ja": ("電車が2時間で120キロメートル走ります。平均の速さはいくらですか？",
           "平均の速さは距離を時間で割ったものです。距離は120キロメートルで、時間は2時間なので、速さは "
           "$120/2 = 60$ キロメートル毎時です。",
           "電車の平均の速さは $\\boxed{60}$ キロメートル毎時です。"),
    "ko": ("기차가 2시간 동안 120km를 달립니다. 평균 속력은 얼마입니까?",
           "평균 속력은 거리를 시간으로 나눈 값입니다. 거리는 120km이고 시간은 2시간이므로 속력은 "
           "$120/2 = 60$ km/h입니다.",
           "기차의 평균 속력은 $\\boxed{60}$ km/h입니다."),
    "ar": ("يقطع قطار مسافة 120 كيلومترا في ساعتين. ما هي سرعته المتوسطة؟",
           "السرعة المتوسطة هي المسافة مقسومة على الزمن. المسافة هي 120 كيلومترا والزمن ساعتان، إذن "
           "السرعة هي $120/2 = 60$ كيلومترا في الساعة.",
           "السرعة المتوسطة للقطار هي $\\boxed{60}$ كيلومترا في الساعة."),
    "hi": ("एक ट्रेन 2 घंटे में 120 किलोमीटर चलती है। उसकी औसत गति क्या है?",
           "औसत गति दूरी को समय से भाग देने पर मिलती है। दूरी 120 किलोमीटर है और समय 2 घंटे है, इसलिए "
           "गति $120/2 = 60$ किलोमीटर प्रति घंटा है।",
           "ट्रेन की औसत गति $\\boxed{60}$ किलोमीटर प्रति घंटा है।"),
    "tr": ("Bir tren 2 saatte 120 km yol alıyor. Ortalama hızı nedir?",
           "Ortalama hız, yolun zamana bölümüdür. Yol 120 km ve süre 2 saat olduğuna göre hız "
           "$120/2 = 60$ km/sa olur.",
           "Trenin ortalama hızı $\\boxed{60}$ km/sa'tir."),
    "vi": ("Một đoàn tàu đi được 120 km trong 2 giờ. Vận tốc trung bình của nó là bao nhiêu?",
           "Vận tốc trung bình bằng quãng đường chia cho thời gian. Quãng đường là 120 km và thời gian là "
           "2 giờ, nên vận tốc là $120/2 = 60$ km/h.",
           "Vận tốc trung bình của đoàn tàu là $\\boxed{60}$ km/h."),
    "pl": ("Pociąg przejeżdża 120 km w ciągu 2 godzin. Jaka jest jego średnia prędkość?",
           "Średnia prędkość to droga podzielona przez czas. Droga wynosi 120 km, a czas 2 godziny, więc "
           "prędkość wynosi $120/2 = 60$ km/h.",
           "Średnia prędkość pociągu wynosi $\\boxed{60}$ km/h."),
    "uk": ("Потяг проїжджає 120 км за 2 години. Яка його середня швидкість?",
           "Середня швидкість дорівнює відстані, поділеній на час. Відстань становить 120 км, а час 2 "
           "години, тому швидкість дорівнює $120/2 = 60$ км/год.",
           "Середня швидкість потяга становить $\\boxed{60}$ км/год."),
}


@pytest.mark.parametrize("tag", list(TRAIN))
def test_each_language_alone_is_consistent_and_english_thoughts_are_not(tag):
    problem, thoughts, answer = TRAIN[tag]
    lang = tag.split("-")[0]
    ok, details = L.check_consistency(problem, thoughts, answer)
    assert ok and details["reference"] == lang, details
    assert L.detect(thoughts)[0] == lang
    if lang != "en":
        assert not L.is_consistent(problem, TRAIN["en"][1], answer)  # thinking in English
        assert not L.is_consistent(problem, thoughts, TRAIN["en"][2])  # answering in English
        assert not L.is_consistent(TRAIN["en"][0], thoughts, answer)  # an English user answered in it


def test_unicode_forms_keep_words_whole():
    # Devanagari vowel signs are combining marks: "गति" was cut into "ग", "त" (too short to weigh)
    assert "औसत गति दूरी को समय से भाग" in L.clean(TRAIN["hi"][1])
    # decomposed accents (NFD), full-width Latin, Arabic vowel points, bidi and zero-width marks
    vi = "Vận tốc trung bình bằng quãng đường chia cho thời gian đã đi được."
    assert L.detect(unicodedata.normalize("NFD", vi))[0] == "vi"
    assert L.detect("Ｔｈｅ ａｖｅｒａｇｅ ｓｐｅｅｄ ｉｓ ｔｈｅ ｄｉｓｔａｎｃｅ ｄｉｖｉｄｅｄ ｂｙ ｔｈｅ ｔｉｍｅ．")[0] == "en"
    assert L.clean("السُّرْعَةُ المُتَوَسِّطَةُ هِيَ المَسَافَةُ") == "السرعة المتوسطة هي المسافة"
    assert L.clean("\u200fالسرعة\u200f هي المسافة") == "السرعة هي المسافة"
    assert L.clean("La vi\u200btesse moy\u00adenne") == "La vitesse moyenne"
    # a word glued across scripts ("km/h입니다") is cut there, not read as Latin
    assert "입니다" in L.clean("60 km/h입니다").split(". ")


def test_short_answer_in_korean_is_judged():
    # 11 Hangul syllables carry ~25 letters of text; counted as 11 letters the answer was never judged
    assert not L.is_consistent(TRAIN["en"][0], TRAIN["en"][1], TRAIN["ko"][2])


WEAK_PROBLEMS = {  # a few words of prose around the formula: lid.176 cannot classify the problem
    "ru": ("Решите $x^2=4$.", "Возводим обе части в квадрат и получаем два решения: два и минус два, проверяем "
                             "подстановкой.", "Ответ: $\\boxed{\\pm 2}$."),
    "ko": ("$x^2=4$을 풀어라.", "양변에 제곱근을 취하면 해는 이와 음의 이입니다. 대입하여 확인하면 모두 성립합니다.",
           "해는 $\\boxed{\\pm 2}$입니다."),
    "ar": ("حل المعادلة $x^2=4$.",
           "نأخذ الجذر التربيعي للطرفين فنحصل على حلين هما اثنان وسالب اثنين، ونتحقق منهما بالتعويض.",
           "الحلول هي $\\boxed{\\pm 2}$."),
    "zh": ("解 $x^2=4$。", "两边开平方，得到的解是二和负二，代入原方程检验都成立。", "方程的解是 $\\boxed{\\pm 2}$。"),
    "en": ("Solve $x^2=4$.", "We take square roots of both sides, so the solutions are two and minus two, which "
                             "we check by substitution.", "The solutions are $\\boxed{\\pm 2}$."),
}


@pytest.mark.parametrize("lang", list(WEAK_PROBLEMS))
def test_a_weak_problem_still_fixes_the_writing_system(lang):
    problem, thoughts, answer = WEAK_PROBLEMS[lang]
    assert L.is_consistent(problem, thoughts, answer)
    other = "zh" if lang == "en" else "en"
    assert not L.is_consistent(problem, WEAK_PROBLEMS[other][1], WEAK_PROBLEMS[other][2])


def test_a_weak_latin_problem_defers_to_the_response():
    # documented choice: one French word ("Résoudre") cannot be told from English by lid.176
    assert L.is_consistent("Résoudre $x^2=4$.", WEAK_PROBLEMS["en"][1], WEAK_PROBLEMS["en"][2])
    # but a French problem with a few words is French, and English thinking is penalised
    problem = "Soit $f(x) = x^2 - 4$. Déterminer les racines réelles de $f$."
    assert L.check_consistency(problem, "", "")[1]["reference"] == "fr"
    assert not L.is_consistent(problem, WEAK_PROBLEMS["en"][1], WEAK_PROBLEMS["en"][2])


# The same exchange in close relatives (a shop sells apples at 3 euros a kilo; 4 kilos paid with 20).
RELATIVES = {
    "es": ("Una tienda vende manzanas a 3 euros el kilo. Si Juan compra 4 kilos y paga con un billete de 20 "
           "euros, ¿cuánto cambio recibe?",
           "Primero calculamos el precio total de las manzanas: cuatro kilos por tres euros cada uno son doce "
           "euros. Después restamos ese importe del billete de veinte euros. Por lo tanto, el cambio es de ocho "
           "euros. Comprobamos: doce más ocho son veinte, así que el resultado es correcto."),
    "gl": ("Unha tenda vende mazás a 3 euros o quilo. Se Xoán compra 4 quilos e paga cun billete de 20 euros, "
           "canto cambio recibe?",
           "Primeiro calculamos o prezo total das mazás: catro quilos por tres euros cada un son doce euros. "
           "Despois restamos ese importe do billete de vinte euros. Polo tanto, o cambio é de oito euros. "
           "Comprobamos: doce máis oito son vinte, así que o resultado é correcto."),
    "pt": ("Uma loja vende maçãs a 3 euros o quilo. Se o João compra 4 quilos e paga com uma nota de 20 euros, "
           "quanto troco recebe?",
           "Primeiro calculamos o preço total das maçãs: quatro quilos vezes três euros cada um são doze euros. "
           "Depois subtraímos esse valor da nota de vinte euros. Portanto, o troco é de oito euros. Verificamos: "
           "doze mais oito são vinte, então o resultado está correto."),
    "ru": ("Магазин продаёт яблоки по 3 евро за килограмм. Иван покупает 4 килограмма и платит купюрой в 20 "
           "евро. Сколько сдачи он получит?",
           "Сначала найдём общую стоимость яблок: четыре килограмма по три евро стоят двенадцать евро. Затем "
           "вычтем эту сумму из двадцати евро. Значит, сдача составляет восемь евро. Проверим: двенадцать плюс "
           "восемь равно двадцати, всё верно."),
    "uk": ("Магазин продає яблука по 3 євро за кілограм. Іван купує 4 кілограми і платить купюрою у 20 євро. "
           "Скільки решти він отримає?",
           "Спочатку знайдемо загальну вартість яблук: чотири кілограми по три євро коштують дванадцять євро. "
           "Потім віднімемо цю суму від двадцяти євро. Отже, решта становить вісім євро. Перевіримо: дванадцять "
           "плюс вісім дорівнює двадцяти, усе правильно."),
    "bg": ("Магазин продава ябълки по 3 евро за килограм. Иван купува 4 килограма и плаща с банкнота от 20 "
           "евро. Колко ресто ще получи?",
           "Първо намираме общата цена на ябълките: четири килограма по три евро струват дванадесет евро. След "
           "това изваждаме тази сума от двадесет евро. Следователно рестото е осем евро. Проверка: дванадесет "
           "плюс осем е равно на двадесет, значи всичко е вярно."),
    "id": ("Sebuah toko menjual apel seharga 3 euro per kilogram. Jika Budi membeli 4 kilogram dan membayar "
           "dengan uang 20 euro, berapa kembalian yang ia terima?",
           "Pertama kita hitung harga total apel: empat kilogram dikali tiga euro sama dengan dua belas euro. "
           "Kemudian kita kurangkan jumlah itu dari dua puluh euro. Jadi kembaliannya adalah delapan euro. Kita "
           "periksa: dua belas ditambah delapan sama dengan dua puluh, jadi hasilnya benar."),
    "ms": ("Sebuah kedai menjual epal pada harga 3 euro sekilogram. Jika Ali membeli 4 kilogram dan membayar "
           "dengan wang kertas 20 euro, berapakah baki yang diterimanya?",
           "Pertama, kita kira jumlah harga epal: empat kilogram darab tiga euro ialah dua belas euro. Kemudian "
           "kita tolak jumlah itu daripada dua puluh euro. Oleh itu, bakinya ialah lapan euro. Kita semak: dua "
           "belas tambah lapan ialah dua puluh, jadi jawapannya betul."),
    "no": ("En butikk selger epler for 3 euro kiloen. Hvis Ola kjøper 4 kilo og betaler med en tjueeuroseddel, "
           "hvor mye får han igjen?",
           "Først regner vi ut totalprisen for eplene: fire kilo ganger tre euro blir tolv euro. Deretter trekker "
           "vi dette beløpet fra tjue euro. Altså får han åtte euro tilbake. Vi sjekker: tolv pluss åtte er tjue, "
           "så svaret stemmer."),
    "da": ("En butik sælger æbler til 3 euro pr. kilo. Hvis Ole køber 4 kilo og betaler med en tyveeuroseddel, "
           "hvor mange penge får han tilbage?",
           "Først udregner vi den samlede pris for æblerne: fire kilo gange tre euro giver tolv euro. Derefter "
           "trækker vi dette beløb fra tyve euro. Altså får han otte euro tilbage. Vi kontrollerer: tolv plus "
           "otte er tyve, så svaret passer."),
}


@pytest.mark.parametrize("lang", list(RELATIVES))
def test_a_monolingual_text_in_a_close_relative_is_consistent(lang):
    # lid.176 calls one clause of the Galician text "pt" at 0.93 and the Malay problem "id": near misses
    problem, thoughts = RELATIVES[lang]
    assert L.is_consistent(problem, thoughts, "$\\boxed{8}$")


@pytest.mark.parametrize("user,reply", [("es", "pt"), ("pt", "es"), ("es", "gl"), ("ru", "uk"), ("uk", "ru"),
                                        ("ru", "bg"), ("bg", "ru"), ("id", "ms"), ("no", "da"), ("da", "no")])
def test_thinking_in_a_close_relative_is_a_switch(user, reply):
    # ru -> bg was missed: Bulgarian shares и, на, по with Russian, and the function-word veto took
    # them as evidence for Russian
    assert not L.is_consistent(RELATIVES[user][0], RELATIVES[reply][1], "$\\boxed{8}$")


def test_english_terms_glossed_in_chinese_are_not_a_switch():
    problem = "给定一个整数数组，求最长递增子序列的长度。"
    answer = "最长递增子序列的长度是 $\\boxed{4}$。"
    glossed = ["我们用动态规划（dynamic programming）求解，时间复杂度（time complexity）是 $O(n^2)$。状态转移方程很简单。",
               "这是经典的最长递增子序列问题（longest increasing subsequence），可以用二分查找优化到 $O(n \\log n)$。",
               "线性模型（linear regression）对每个输入有一个权重，另外还有一个偏置 bias。所以一共是十个权重加一个偏置。"]
    for thoughts in glossed:
        assert L.is_consistent(problem, thoughts, answer), thoughts
    # English grammar mixed into the Chinese is the language mixing the reward is there to stop
    mixed = ["所以我们 need to consider 每一个 element，然后 we compute the 长度 of the 子序列。",
             "首先 let me think，这个问题 is about 递增子序列，we can use 动态规划 to solve it。"]
    for thoughts in mixed:
        assert not L.is_consistent(problem, thoughts, answer), thoughts
