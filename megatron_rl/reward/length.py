"""DAPO's soft overlong penalty, as used by Magistral, and a token-count fallback estimate.

    penalty(len) = 0                                       if len <= l_max - l_cache
                 = -p * (len - (l_max - l_cache)) / l_cache  if l_max - l_cache < len <= l_max
                 = -p                                      if len > l_max
with p = RewardConfig.overlong_penalty (0.1). ``len`` is the completion length in TOKENS.
"""
from __future__ import annotations

import math
import re

# Han, kana, hangul: BPE tokenizers of multilingual LLMs spend about one token per character.
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
CHARS_PER_TOKEN = 4.0  # the usual rule of thumb for English/Latin text and code


def overlong_penalty(num_tokens: int, l_max: int, l_cache: int, penalty: float = 0.1) -> float:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if l_max <= 0 or not 0 <= l_cache <= l_max:
        raise ValueError(f"need l_max > 0 and 0 <= l_cache <= l_max, got l_max={l_max}, l_cache={l_cache}")
    if num_tokens <= l_max - l_cache:
        return 0.0
    if num_tokens > l_max:  # also covers l_cache == 0: a hard step at l_max
        return -penalty
    # the fraction first: at num_tokens == l_max it is exactly 1, so the penalty meets -p exactly
    return -penalty * ((num_tokens - (l_max - l_cache)) / l_cache)


def estimate_tokens(text: str) -> int:
    """Token count estimate used when the caller does not pass the real count.

    One token per CJK character plus one per CHARS_PER_TOKEN other characters (rounded up). Callers
    that have the generator's token ids (the training loop always does) should pass the real count.
    """
    n_cjk = len(_CJK.findall(text))
    return n_cjk + math.ceil((len(text) - n_cjk) / CHARS_PER_TOKEN)
