"""Translate a chosen fraction of a problem set through an OpenAI-compatible chat endpoint.

Magistral translates ~10% of its problems into French, Spanish, Italian, German, Chinese and Russian
so that the language-consistency reward has non-English problems to act on. `translate_problems`
picks `fraction` of the problems (seeded), assigns target languages round-robin, asks the endpoint
(`POST {base_url}/v1/chat/completions`; an SGLang server counts) for a translation of the problem
text only, and checks each translation's language with the fastText detector
(`reward.language.detect`). Translations in the wrong language, or empty, are rejected and counted.
Answers and code tests are never sent nor touched: the translated problem keeps the original
task with only its `problem` text replaced, and gets `language` set to the target.
"""
from __future__ import annotations

import copy
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from megatron_rl.records import Problem

LANGUAGES = {"fr": "French", "es": "Spanish", "it": "Italian", "de": "German", "zh": "Chinese", "ru": "Russian"}
SYSTEM = ("You are a translator. Translate the user's problem statement into {language}. Keep every "
          "number, formula, LaTeX expression and code identifier exactly as it is. Output only the "
          "translation, nothing else.")


class EndpointError(RuntimeError):
    pass


class ChatClient:
    """Minimal client of `/v1/chat/completions` (OpenAI-compatible: OpenAI, vLLM, SGLang, ...)."""

    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None,
                 timeout_s: float = 300.0, max_tokens: int = 1024, temperature: float = 0.0):
        import requests

        self.url = base_url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        self.model, self.timeout_s = model, timeout_s
        self.max_tokens, self.temperature = max_tokens, temperature
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def chat(self, messages: list[dict[str, str]]) -> str:
        import requests

        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}
        try:
            r = self.session.post(self.url, json=body, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise EndpointError(f"{self.url}: {e}") from e
        if r.status_code != 200:
            raise EndpointError(f"{self.url} -> HTTP {r.status_code}: {r.text[:300]}")
        try:
            return r.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise EndpointError(f"{self.url}: unexpected answer {r.text[:300]!r}") from e


@dataclass
class TranslationReport:
    problems: list[Problem] = field(default_factory=list)  # output set
    selected: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    by_language: Counter = field(default_factory=Counter)  # accepted per target language
    rejections: list[dict] = field(default_factory=list)  # {id, target, detected, text} (first few)

    def summary(self) -> dict:
        return {"output_problems": len(self.problems), "selected": self.selected, "accepted": self.accepted,
                "rejected": dict(self.rejected), "accepted_by_language": dict(self.by_language)}


def translate_one(client: ChatClient, text: str, lang: str) -> str:
    messages = [{"role": "system", "content": SYSTEM.format(language=LANGUAGES[lang])},
                {"role": "user", "content": text}]
    return client.chat(messages).strip()


def translate_problems(problems: list[Problem], client: ChatClient, fraction: float = 0.1,
                       languages: list[str] | None = None, seed: int = 0, mode: str = "add",
                       workers: int = 4, min_confidence: float = 0.0) -> TranslationReport:
    """`mode="add"`: output = originals + accepted translations; `"replace"`: translations replace
    their originals (rejected ones keep the original)."""
    from megatron_rl.reward.language import detect

    languages = list(languages or LANGUAGES)
    unknown = [l for l in languages if l not in LANGUAGES]
    if unknown:
        raise ValueError(f"unknown target language(s) {unknown} (known: {list(LANGUAGES)})")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    if mode not in ("add", "replace"):
        raise ValueError(f"mode must be 'add' or 'replace', got {mode!r}")
    n = round(fraction * len(problems))
    chosen = sorted(random.Random(seed).sample(range(len(problems)), n))
    targets = {i: languages[j % len(languages)] for j, i in enumerate(chosen)}
    with ThreadPoolExecutor(max(1, workers)) as ex:
        texts = dict(zip(chosen, ex.map(lambda i: translate_one(client, problems[i].prompt, targets[i]), chosen)))
    report = TranslationReport(selected=n)
    translated: dict[int, Problem] = {}
    for i in chosen:
        p, lang, text = problems[i], targets[i], texts[i]
        detected, conf = detect(text) if text else ("und", 0.0)
        reason = "empty" if not text else ("wrong_language" if detected != lang or conf < min_confidence else None)
        if reason:
            report.rejected[reason] += 1
            if len(report.rejections) < 20:
                report.rejections.append({"id": p.problem_id, "target": lang, "detected": detected, "text": text[:200]})
            continue
        task = copy.deepcopy(p.task)
        if "problem" in task:
            task["problem"] = text
        translated[i] = Problem(f"{p.problem_id}-{lang}", text, task, lang)
        report.accepted += 1
        report.by_language[lang] += 1
    for i, p in enumerate(problems):
        if mode == "replace" and i in translated:
            report.problems.append(translated[i])
            continue
        report.problems.append(p)
    if mode == "add":
        report.problems.extend(translated[i] for i in chosen if i in translated)
    return report
