"""Translate a chosen fraction of a problem set through an OpenAI-compatible chat endpoint.

Magistral translates ~10% of its problems into French, Spanish, Italian, German, Chinese and Russian
so that the language-consistency reward has non-English problems to act on. `translate_problems`
picks `fraction` of the problems (seeded; at least one for a fraction above 0), assigns target
languages round-robin, asks the endpoint (`POST {base_url}/v1/chat/completions`; an SGLang server
counts) for a translation of the problem text only, and checks each translation's language with the
fastText detector (`reward.language.detect`). Translations in the wrong language, or empty, are rejected and counted.
Answers and code tests are never sent nor touched: the translated problem keeps the original
task with only its `problem` text replaced, and gets `language` set to the target.

A request that fails for a reason that may pass (no connection, timeout, HTTP 408/429/5xx) is retried
with exponential backoff (`retries`, `backoff_s`). Each translation is appended to a partial file
as it arrives (`partial`: {problem_id, language, text} lines), and a rerun with the same file sends
only the requests it lacks; so one failure loses nothing already paid for.
"""
from __future__ import annotations

import copy
import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.log import get_logger
from megatron_rl.progress import Progress
from megatron_rl.records import Problem

log = get_logger(__name__)
RETRIED_STATUS = (408, 429, 500, 502, 503, 504)  # the server may answer later; other 4xx will not change
MAX_BACKOFF_S = 60.0

LANGUAGES = {"fr": "French", "es": "Spanish", "it": "Italian", "de": "German", "zh": "Chinese", "ru": "Russian"}
SYSTEM = ("You are a translator. Translate the user's problem statement into {language}. Keep every "
          "number, formula, LaTeX expression and code identifier exactly as it is. Output only the "
          "translation, nothing else.")


class EndpointError(RuntimeError):
    pass


class ChatClient:
    """Minimal client of `/v1/chat/completions` (OpenAI-compatible: OpenAI, vLLM, SGLang, ...)."""

    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None,
                 timeout_s: float = 300.0, max_tokens: int = 1024, temperature: float = 0.0,
                 retries: int = 5, backoff_s: float = 1.0):
        import requests

        if retries < 0 or backoff_s < 0:
            raise ValueError(f"retries and backoff must be >= 0, got {retries} and {backoff_s}")
        self.url = base_url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        self.retries, self.backoff_s = retries, backoff_s
        self.model, self.timeout_s = model, timeout_s
        self.max_tokens, self.temperature = max_tokens, temperature
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def chat(self, messages: list[dict[str, str]]) -> str:
        """The answer's text; retries transient failures `retries` times, waiting backoff_s, 2 backoff_s,
        4 backoff_s, ... (at most MAX_BACKOFF_S) between tries; EndpointError when they are spent."""
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}
        for attempt in range(self.retries + 1):
            r, error = self._post(body)
            if error is None:
                break
            if attempt == self.retries or (r is not None and r.status_code not in RETRIED_STATUS):
                raise EndpointError(error + (f" (after {attempt + 1} tries)" if attempt else ""))
            wait_s = min(MAX_BACKOFF_S, self.backoff_s * 2 ** attempt)
            log.warning("%s; retry %d/%d in %.1f s", error, attempt + 1, self.retries, wait_s)
            time.sleep(wait_s)
        try:
            return r.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise EndpointError(f"{self.url}: unexpected answer {r.text[:300]!r}") from e

    def _post(self, body: dict):
        """(response, None) on HTTP 200, else (response or None, why it failed)."""
        import requests

        try:
            r = self.session.post(self.url, json=body, timeout=self.timeout_s)
        except requests.RequestException as e:
            return None, f"{self.url}: {e}"
        if r.status_code != 200:
            return r, f"{self.url} -> HTTP {r.status_code}: {r.text[:300]}"
        return r, None


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


class PartialFile:
    """The translations received so far, one JSON line each, appended (and flushed) as they arrive."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()

    def read(self) -> dict[tuple[str, str], str]:
        """(problem_id, language) -> text of an earlier run; a line cut by a crash is skipped."""
        if self.path is None or not self.path.is_file():
            return {}
        done = {}
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                done[(row["problem_id"], row["language"])] = row["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        return done

    def add(self, problem_id: str, language: str, text: str) -> None:
        if self.path is None:
            return
        line = json.dumps({"problem_id": problem_id, "language": language, "text": text}, ensure_ascii=False)
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


def _request_all(problems: list[Problem], client: ChatClient, targets: dict[int, str], workers: int,
                 partial: PartialFile) -> dict[int, str]:
    """Text of every chosen problem: from the partial file, else from the endpoint (saved as it comes).
    On an error the requests not yet sent are cancelled, the finished ones kept, and the error raised."""
    done = partial.read()
    texts = {i: done[(problems[i].problem_id, lang)] for i, lang in targets.items()
             if (problems[i].problem_id, lang) in done}
    if texts:
        log.info("resuming: %d of %d translations already in %s", len(texts), len(targets), partial.path)
    todo = [i for i in targets if i not in texts]
    with Progress(len(targets), "translating", unit="problem") as bar:
        bar.update(len(texts))
        ex = ThreadPoolExecutor(max(1, workers))

        def one(i: int) -> str:
            text = translate_one(client, problems[i].prompt, targets[i])
            partial.add(problems[i].problem_id, targets[i], text)
            bar.update(1)
            return text

        futures = {ex.submit(one, i): i for i in todo}
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
    for future, i in futures.items():
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()
        if not future.cancelled():
            texts[i] = future.result()
    return texts


def _how_many(fraction: float, n_problems: int) -> int:
    """round(fraction * n_problems), but at least one problem for a fraction above 0: 10% of a
    4-problem file would otherwise translate nothing and look like a successful run."""
    if fraction == 0.0 or n_problems == 0:
        return 0
    return max(1, round(fraction * n_problems))


def translate_problems(problems: list[Problem], client: ChatClient, fraction: float = 0.1,
                       languages: list[str] | None = None, seed: int = 0, mode: str = "add",
                       workers: int = 4, min_confidence: float = 0.0,
                       partial: str | Path | None = None) -> TranslationReport:
    """`mode="add"`: output = originals + accepted translations; `"replace"`: translations replace
    their originals (rejected ones keep the original). `partial`: the file of translations received
    so far (see PartialFile), read first; the caller removes it once the output is written."""
    from megatron_rl.reward.language import detect

    languages = list(languages or LANGUAGES)
    unknown = [l for l in languages if l not in LANGUAGES]
    if unknown:
        raise ValueError(f"unknown target language(s) {unknown} (known: {list(LANGUAGES)})")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    if mode not in ("add", "replace"):
        raise ValueError(f"mode must be 'add' or 'replace', got {mode!r}")
    n = _how_many(fraction, len(problems))
    log.info("translating %d of %d problems (fraction %g)", n, len(problems), fraction)
    chosen = sorted(random.Random(seed).sample(range(len(problems)), n))
    targets = {i: languages[j % len(languages)] for j, i in enumerate(chosen)}
    store = PartialFile(partial)
    texts = _request_all(problems, client, targets, workers, store)
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
