"""The text side of language consistency: strip what is not prose, cut the rest into windows.

Everything here runs in time linear in the input (responses can be a megabyte of hostile text):

- ``strip_markup`` removes code and LaTeX math with a left-to-right scanner instead of lazy regexes.
  A regex such as ``\\[.*?\\]`` rescans to the end of the text for every unclosed opener, which is
  quadratic on "\\[" repeated 100k times; the scanner charges every failed closer search to a budget
  of a few times the text length and, once it is spent, treats remaining openers as plain text.
- ``normalize`` (NFKC, minus invisible format characters and Arabic/Hebrew vowel points) runs first.
- ``segments`` tokenises prose into units (a word, combining marks included; a word that changes
  writing system is cut there; a piece of at most ``_CJK_PIECE`` CJK characters,
  since Chinese and Japanese have no spaces; a giant "word" is cut into ``_MAX_WORD``-letter pieces)
  and groups them into segments: one clause (cut at sentence punctuation and commas) in one writing
  system. Formulas are gone by then, so they never reach the classifier (they are language-neutral).
- ``windows`` turns segments into the texts that get classified (see its docstring).
"""
from __future__ import annotations

import functools
import re
import unicodedata

# Kana, CJK ideographs (incl. extension A and compatibility), half-width katakana.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
_KANA = re.compile(r"[\u3040-\u30ff\uff66-\uff9f]")
# Dropped before tokenising: invisible format characters (bidi marks, zero-width joiners and spaces,
# soft hyphen, BOM), which sit inside words of Arabic, Persian, Hindi, ... and would cut them in two;
# and the optional vowel points of Arabic (harakat, tatweel) and Hebrew (niqqud): lid.176 learnt these
# languages unpointed (a pointed Arabic sentence gets "ar" 0.41, unpointed 0.99).
_DROP = re.compile("[\u00ad\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff"
                   "\u0610-\u061a\u064b-\u065f\u0640\u0670\u06d6-\u06dc\u06df-\u06e4\u06e7\u06e8\u06ea-\u06ed"
                   "\u0591-\u05bd\u05bf\u05c1\u05c2\u05c4\u05c5\u05c7]+")
_JOINED = re.compile(r"['’\-]")
_HANGUL_WEIGHT = 2  # letters a Hangul syllable counts for (a short Korean answer is judged like a Latin one)
_CJK_PIECE = 4  # CJK characters per unit: windows can cut a CJK run at this granularity
_MAX_WORD = 40  # longer "words" (no spaces: Thai, hostile input) are cut into pieces of this size

_FIXED_CLOSER = {"```": "```", "$$": "$$", "\\[": "\\]", "\\(": "\\)"}
_INLINE_MAX = 2000  # an inline $..$ longer than this is a lone dollar sign, not math
_CODE_SPAN_MAX = 500  # an inline `code` span ends on its own line, within this many characters
_URL = re.compile(r"https?://\S+|www\.\S+")
_THINK_TAGS = re.compile(r"</?think>")
_COMMAND = re.compile(r"\\[A-Za-z]+\*?")


@functools.lru_cache(maxsize=16)
def _openers(dead: frozenset[str]) -> re.Pattern:
    """Openers still worth looking at: once "\\]" is absent from the rest of the text, every later
    "\\[" is plain text, and dropping it from the pattern skips them all in one regex scan.
    \\\\ (a LaTeX line break) and \\$ (an escaped dollar) are matched so that they open nothing."""
    fixed = [o for o in ("```", "$$", "\\[", "\\(") if _FIXED_CLOSER[o] not in dead]
    alts = [r"\\\\", r"\\\$"] + [re.escape(o) for o in fixed] + ["`", r"\$", r"\\begin\{([A-Za-z*]{1,40})\}"]
    return re.compile("|".join(alts))


def _close(text: str, i: int, opener: str, env: str | None) -> tuple[str | None, int, int]:
    """(closer, search start, search end) for the opener at ``i``; closer None: plain text."""
    start = i + len(opener)
    if env is not None:
        return "\\end{" + env + "}", start, len(text)
    if opener == "$":
        return "$", start, min(len(text), start + _INLINE_MAX)
    if opener == "`":
        return "`", start, min(len(text), start + _CODE_SPAN_MAX)
    return _FIXED_CLOSER.get(opener), start, len(text)


def strip_markup(text: str) -> str:
    """Remove fenced/inline code, LaTeX math (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``,
    environments), LaTeX commands, URLs and think tags. Block-level spans become a newline (a
    sentence break), inline spans a space. Unclosed openers stay as text, except an unclosed code
    fence, which runs to the end (a truncated response)."""
    out: list[str] = []
    pos, n = 0, len(text)
    budget = 4 * n + 10_000  # characters that failed closer searches may scan in total
    dead: set[str] = set()  # closers known to be absent from here on (their search already failed)
    openers = _openers(frozenset())
    while pos < n:
        m = openers.search(text, pos)
        if m is None:
            break
        opener, env, i = m.group(0), m.group(1), m.start()
        closer, lo, hi = _close(text, i, opener, env)
        if closer is None or budget <= 0 or (closer in dead and hi == n):
            out.append(text[pos:m.end()])  # \\ , \$ , or an opener we may no longer search for
            pos = m.end()
            continue
        j = text.find(closer, lo, hi)
        if opener == "`" and j >= 0 and "\n" in text[lo:j]:
            j = -1
        if j < 0 and opener == "```":
            j, closer = n, ""
        if j < 0:
            budget -= hi - lo
            if hi == n:
                dead.add(closer)
                openers = _openers(frozenset(dead & set(_FIXED_CLOSER.values())))
            out.append(text[pos:m.end()])
            pos = m.end()
            continue
        block = opener in ("```", "$$", "\\[") or env is not None
        out.append(text[pos:i])
        out.append("\n" if block else " ")
        pos = j + len(closer)
    out.append(text[pos:])
    text = "".join(out)
    text = _URL.sub(" ", text)
    text = _THINK_TAGS.sub("\n", text)
    return _COMMAND.sub(" ", text)


@functools.lru_cache(maxsize=1)
def _token_re() -> re.Pattern:
    """Tokens of the stripped text. A word is a letter followed by letters and combining marks:
    Devanagari and other Indic vowel signs are marks (not \\w), and without them "गति" falls apart
    into one-letter words too short to weigh. A colon ends a clause after CJK text (NFKC made the
    full-width "：" an ASCII ":"); "2.5" and "e.g" end none. Built on first use: the mark class is
    read from unicodedata (~40 ms)."""
    marks, start, prev = [], None, None
    for c in [*range(0x20000), *range(0xE0100, 0xE01F0)]:
        if unicodedata.category(chr(c))[0] == "M":
            if start is None or c != prev + 1:
                if start is not None:
                    marks.append((start, prev))
                start = c
            prev = c
    marks.append((start, prev))
    m = "".join(re.escape(chr(a)) + (f"-{re.escape(chr(b))}" if b > a else "") for a, b in marks)
    letter = rf"[^\W\d_{_CJK}]"
    return re.compile(
        rf"(?P<cjk>[{_CJK}]+)"
        rf"|(?P<word>{letter}+(?:[{m}]+{letter}*)*(?:['’\-]{letter}+(?:[{m}]+{letter}*)*)*)"  # other scripts
        rf"|(?P<stop>[!?;…\n。！？；：؟؛,，、،।॥۔]+|\.(?!\w)|(?<=[{_CJK}]):)")  # clause ends


def normalize(text: str) -> str:
    """NFKC (full-width "Ｔｈｅ" is "The", a decomposed "é" one letter, Arabic presentation forms
    plain letters), then without the characters of ``_DROP``."""
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    return _DROP.sub("", text)


@functools.lru_cache(maxsize=4096)
def script_of(ch: str) -> str:
    """Writing system of a letter: latin, cjk, cyrillic, arabic, greek, hangul, ..."""
    if ch.isascii():
        return "latin"
    name = unicodedata.name(ch, "")
    if name.startswith(("CJK", "HIRAGANA", "KATAKANA")) or "IDEOGRAPH" in name:
        return "cjk"
    return name.split(" ", 1)[0].lower() or "other"


def _script_runs(word: str) -> list[tuple[str, str]]:
    """(run, script) of a word written in several scripts; marks and joiners stay with their run."""
    runs, start, cur = [], 0, ""
    for k, ch in enumerate(word):
        if not ch.isalpha():
            continue
        script = script_of(ch)
        if cur and script != cur:
            runs.append((word[start:k], cur))
            start = k
        cur = script
    runs.append((word[start:], cur))
    return runs


def _pieces(word: str, script: str) -> list[Unit]:
    """Units of a word of one script: the word, or pieces of ``_MAX_WORD`` letters of a giant one."""
    per = _HANGUL_WEIGHT if script == "hangul" else 1
    return [(word[k:k + _MAX_WORD], per * len(word[k:k + _MAX_WORD]), script)
            for k in range(0, len(word), _MAX_WORD)]


# A unit is a tuple (text, weight, script): tuples, not objects, because a megabyte of prose makes
# 200k of them. weight: letters, a CJK character counting cjk_weight, a Hangul syllable (2-3 jamo)
# _HANGUL_WEIGHT, a one-letter word 0; script is "" for weight-0 units, which never split a segment.
Unit = tuple


def segments(text: str, cjk_weight: int) -> list[list[Unit]]:
    """Clauses of the stripped text, split further wherever the writing system changes."""
    out: list[list[Unit]] = []
    cur: list[Unit] = []
    cur_script, cur_weight = "", 0
    for m in _token_re().finditer(strip_markup(normalize(text))):
        kind, tok = m.lastgroup, m.group(0)
        if kind == "stop":
            units = ()
        elif kind == "word" and not tok.isascii() and script_of(tok[0]) != script_of(tok[-1]):
            # "h입니다", "x좌표" (a unit, a variable glued to Korean): one unit per writing system
            units = [u for run, script in _script_runs(tok) if len(run) > 1 for u in _pieces(run, script)]
        elif kind == "cjk":
            units = [(tok[k:k + _CJK_PIECE], cjk_weight * len(tok[k:k + _CJK_PIECE]), "cjk")
                     for k in range(0, len(tok), _CJK_PIECE)]
        elif len(tok) == 1:
            if tok.isascii():
                continue  # x, n, s: variables of plain-text math; they steer lid.176 to es/ro/...
            units = ((tok, 0, ""),)  # à, и, в: kept for the classifier, too short to weigh
        elif len(tok) <= _MAX_WORD and tok.isascii() and len(_JOINED.sub("", tok)) * 2 - 1 == len(tok):
            continue  # s-a, x-y: variables joined by a hyphen, not a word
        else:
            units = _pieces(tok, script_of(tok[0]))
        for u in units:
            if u[2] and cur_script and u[2] != cur_script:  # a change of writing system
                out.append(cur)
                cur, cur_script, cur_weight = [], "", 0
            cur.append(u)
            cur_script = u[2] or cur_script
            cur_weight += u[1]
        if kind == "stop" and cur:
            if cur_weight:
                out.append(cur)
            cur, cur_script, cur_weight = [], "", 0
    if cur_weight:
        out.append(cur)
    return out


def _join(units: list[Unit]) -> str:
    parts: list[str] = []
    prev = ""
    for text, _, script in units:
        if parts and not (script == "cjk" and prev == "cjk"):
            parts.append(" ")  # CJK pieces of one run are rejoined without spaces
        parts.append(text)
        prev = script
    return "".join(parts)


def _slide(seg: list[Unit], size: int) -> list[tuple[int, int, int]]:
    """(start, end, weight) of windows of about ``size`` over one long segment, each starting half a
    window after the previous, the last one ending with the segment: every letter is in one or two."""
    out: list[tuple[int, int, int]] = []
    n, start, end, w = len(seg), 0, 0, 0
    while True:
        while end < n and w < size:
            w += seg[end][1]
            end += 1
        out.append((start, end, w))
        if end >= n:
            return out
        dropped = 0
        while start < end and dropped < size // 2:
            dropped += seg[start][1]
            w -= seg[start][1]
            start += 1


def windows(text: str, size: int, min_weight: int, cjk_weight: int,
            max_windows: int) -> list[tuple[str, int, str]]:
    """(text, weight, script) of the windows to classify, in text order.

    A segment (clause in one script) of at least ``min_weight`` is classified alone: as one window
    if it weighs at most ``size``, else by sliding windows of ``size`` (so a switch in the middle of
    a long clause gets a window of its own). Shorter segments ("OK.", "Donc", a foreign name) are
    too short to classify reliably; they are packed, in text order, with the previous short ones of
    the same script until they reach ``min_weight``, and a leftover below it is ignored — unless
    the whole text yields no window, then the heaviest leftover is returned (a one-line answer must
    still be judged).
    Beyond ``max_windows``, an evenly spaced sample of them is returned (texts are only built for
    the sample, so a huge input costs its tokenisation and little more)."""
    spans: list[tuple[list[Unit], int, int, int, str]] = []  # (units, start, end, weight, script)
    pending: dict[str, tuple[list[Unit], int]] = {}  # script -> (packed short segments, weight)
    for seg in segments(text, cjk_weight):
        script = next(u[2] for u in seg if u[2])
        weight = sum(u[1] for u in seg)
        if weight >= min_weight:
            cuts = _slide(seg, size) if weight > size else [(0, len(seg), weight)]
            spans.extend((seg, a, b, w, script) for a, b, w in cuts)
            continue
        buf, buf_w = pending.get(script) or ([], 0)
        buf.extend(seg)
        buf_w += weight
        if buf_w >= min_weight:
            spans.append((buf, 0, len(buf), buf_w, script))
            buf, buf_w = [], 0
        pending[script] = (buf, buf_w)
    if not spans and pending:
        script, (buf, buf_w) = max(pending.items(), key=lambda kv: kv[1][1])
        if buf_w:
            spans.append((buf, 0, len(buf), buf_w, script))
    if len(spans) > max_windows:
        spans = [spans[k * len(spans) // max_windows] for k in range(max_windows)]
    return [(_join(units[a:b]), w, script) for units, a, b, w, script in spans]


def main_script(text: str, cjk_weight: int) -> str | None:
    """Writing system of most of the text's prose letters; None when it has no prose."""
    letters: dict[str, int] = {}
    for seg in segments(text, cjk_weight):
        for _, weight, script in seg:
            if weight:
                letters[script] = letters.get(script, 0) + weight
    return max(letters, key=letters.get) if letters else None


def clean(text: str) -> str:
    """The words language ID sees: no code, math, digits, symbols or variables (clauses joined by
    '. ')."""
    return ". ".join(" ".join(_join(seg).split()) for seg in segments(text, 1))


# Frequent function words of the Latin-script languages lid.176 most often mistakes for one another
# on a clause ("To pour the contents of Jug into Jug" is French at 0.99 for it). Words shared by two
# lists (de, la, on, in, es, ...) cancel out when those two are compared.
FUNCTION_WORDS = {
    "en": set("the of and to in is it that for on with as be this by are we you so then from at not but or "
              "if can have has was will which what into each there now let me get than all must should "
              "also do does".split()),
    "fr": set("le la les de des du un une et est que qui pour dans sur avec pas ne nous vous on il elle ce "
              "cette donc alors mais ou sont par au aux en se son sa ses leur comme puis deux aussi plus "
              "très".split()),
    "de": set("der die das und ist nicht ein eine einen dem den des zu mit auf für von wir ich es sich "
              "auch also dann wenn aber oder sind wird im am zum zur bei nach noch nur so wie dass hier "
              "zwei in".split()),
    "es": set("el la los las de del que en es un una por para con no se su sus lo al como pero más "
              "entonces así este esta son hay muy también dos cuando donde porque ya".split()),
    "it": set("il lo la gli le di del della dei che un una per con non si in da al alla sono come ma "
              "quindi allora questo questa anche più due perché poi ci ha è".split()),
    "pt": set("os as de do da dos das que um uma para com não se em no na por mais como mas ou então "
              "isso este esta são há também dois quando porque ao seu sua é".split()),
    "ru": set("и в не на что с по это как а к из для то так но мы он она они от у же или если чтобы "
              "равно при все его уже тоже только два значит поэтому".split()),
}


def function_word_balance(text: str, ours: str, theirs: str) -> int:
    """Function words of ``theirs`` minus those of ``ours`` in ``text`` (words in both lists
    count for neither); 0 when neither language has a list."""
    a, b = FUNCTION_WORDS.get(ours, set()), FUNCTION_WORDS.get(theirs, set())
    words = text.lower().split()
    return sum(w in b and w not in a for w in words) - sum(w in a and w not in b for w in words)


def function_words(text: str, lang: str) -> int:
    """Function words of ``lang`` in ``text`` (0 when it has no list)."""
    words = FUNCTION_WORDS.get(lang, set())
    return sum(w in words for w in text.lower().split())


def has_kana(text: str) -> bool:
    return _KANA.search(text) is not None
