"""pass@1 / pass@k of sampled completions, graded by the project's verifiers, per language.

`grade_samples(problems, samples, reward_config, workers)` grades every completion: math and
stdin/stdout code tasks through `reward.VerifierPool` (correct = the reward's `correct`, so the
format gate applies exactly as in training), HumanEval tasks through `data.humaneval.grade` (its
own harness; threads, each test already runs in its own sandboxed process).
`summarize(rows, ks)` computes per problem n samples, c correct, and
- pass@1 = mean over problems of c / n (the mean over the k samples),
- pass@k = mean over problems of 1 - C(n - c, k) / C(n, k) (the unbiased estimator of Chen et
  al. 2021; needs n >= k),
overall and per language (`Problem.language`, else `reward.language.detect` of the prompt).
"""
from __future__ import annotations

import math
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_rl.config import RewardConfig
from megatron_rl.records import Problem

from .sampling import Completion


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n} c={c} k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class ProblemResult:
    problem_id: str
    language: str
    n: int
    correct: int
    format_ok: int
    mean_reward: float | None  # None for HumanEval (graded by its harness, not the reward)
    source: str = ""
    statuses: dict[str, int] = field(default_factory=dict)

    @property
    def pass_rate(self) -> float:
        return self.correct / self.n

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pass_rate"] = self.pass_rate
        return d


def problem_language(p: Problem) -> str:
    if p.language:
        return p.language
    from megatron_rl.reward.language import detect

    return detect(p.prompt)[0]


def grade_samples(problems: list[Problem], samples: dict[str, list[Completion]],
                  reward: RewardConfig | None = None, workers: int = 2) -> list[ProblemResult]:
    from megatron_rl.data.humaneval import grade as grade_humaneval, is_humaneval
    from megatron_rl.reward.pool import VerifierPool

    reward = reward or RewardConfig()
    he_items, pool_items = [], []
    for p in problems:
        for j, c in enumerate(samples[p.problem_id]):
            (he_items if is_humaneval(p.task) else pool_items).append((p, j, c))
    verdicts: dict[tuple[str, int], tuple[bool, bool, float | None, str]] = {}
    if pool_items:
        with VerifierPool(reward, workers=workers) as pool:
            results = pool.map([(p.task, c.response, c.num_tokens) for p, _, c in pool_items])
        for (p, j, _), r in zip(pool_items, results):
            status = r.details.get("code_status", r.status) if r.format_ok else "format"
            verdicts[(p.problem_id, j)] = (bool(r.correct), bool(r.format_ok), float(r.total), str(status))
    if he_items:
        with ThreadPoolExecutor(max(1, workers)) as ex:
            results = list(ex.map(lambda it: grade_humaneval(it[0].task, it[2].response,
                                                              reward.code_test_timeout_s * 2.5), he_items))
        for (p, j, _), r in zip(he_items, results):
            verdicts[(p.problem_id, j)] = (r.passed, r.status != "no_code", None, r.status)
    out = []
    for p in problems:
        vs = [verdicts[(p.problem_id, j)] for j in range(len(samples[p.problem_id]))]
        statuses: dict[str, int] = defaultdict(int)
        for v in vs:
            statuses[v[3]] += 1
        rewards = [v[2] for v in vs if v[2] is not None]
        out.append(ProblemResult(p.problem_id, problem_language(p), len(vs), sum(v[0] for v in vs),
                                 sum(v[1] for v in vs), sum(rewards) / len(rewards) if rewards else None,
                                 str(p.task.get("source", "")), dict(statuses)))
    return out


def _metrics(rows: list[ProblemResult], ks: list[int]) -> dict[str, Any]:
    m: dict[str, Any] = {"problems": len(rows), "samples": sum(r.n for r in rows)}
    if not rows:
        return m
    m["pass@1"] = sum(r.pass_rate for r in rows) / len(rows)
    for k in ks:
        if k > 1:
            m[f"pass@{k}"] = sum(pass_at_k(r.n, r.correct, k) for r in rows) / len(rows)
    m["format_rate"] = sum(r.format_ok for r in rows) / m["samples"]
    rewards = [r.mean_reward for r in rows if r.mean_reward is not None]
    if rewards:
        m["mean_reward"] = sum(rewards) / len(rewards)
    return m


def summarize(rows: list[ProblemResult], ks: list[int]) -> dict[str, Any]:
    """Overall metrics plus `by_language` (same metrics per language)."""
    by_lang: dict[str, list[ProblemResult]] = defaultdict(list)
    for r in rows:
        by_lang[r.language].append(r)
    out = _metrics(rows, ks)
    out["by_language"] = {lang: _metrics(rs, ks) for lang, rs in sorted(by_lang.items())}
    return out
