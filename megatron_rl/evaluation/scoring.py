"""pass@1 / pass@k of sampled completions, graded by the project's verifiers, per language.

`grade_samples(problems, samples, reward_config, workers)` grades every completion: math and
stdin/stdout code tasks through `reward.VerifierPool` (correct = the reward's `correct`, so the
format gate applies exactly as in training), HumanEval tasks through `data.humaneval.grade` (the
training reward's function-call grading, without the format gate; threads: each sample is already
graded in its own sandboxed process).
`summarize(rows, ks)` computes per problem n graded samples, c correct, and
- pass@1 = mean over problems of c / n (the mean over the samples),
- pass@k = mean over problems of 1 - C(n - c, k) / C(n, k) (the unbiased estimator of Chen et
  al. 2021; over the problems with n >= k),
overall, per task kind (`task["kind"]`) and per language (`Problem.language`, else
`reward.language.detect` of the prompt). A sample whose grading failed (no verdict: timeout, crash,
error, sandbox_unavailable) is no wrong answer: it is left out of n and counted in `ungradable`.
The evaluation during training (control/evaluation.py) aggregates with the same `problem_result`
and `summarize`.
"""
from __future__ import annotations

import math
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_rl.config import RewardConfig
from megatron_rl.progress import Progress
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
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1..n} (1 - k/i) = prod_{j<k} (1 - c/(n-j)): the shorter product in
    # log space, then -expm1. Exact binomials cost O(n) digit arithmetic (minutes at n = 10^7) and
    # 1 - x loses the relative precision of a small pass@k (n = 10^9, c = 1: 2.8e-8 off).
    if c <= k:
        log_miss = sum(math.log1p(-k / i) for i in range(n - c + 1, n + 1))
    else:
        log_miss = sum(math.log1p(-c / (n - j)) for j in range(k))
    return -math.expm1(log_miss)


@dataclass(frozen=True)
class Verdict:
    """One sample's grading: `gradable` False when no verdict exists (the rest is then meaningless)."""

    correct: bool
    format_ok: bool
    reward: float | None  # None for HumanEval (graded by its harness, not the reward)
    status: str
    gradable: bool = True


@dataclass
class ProblemResult:
    problem_id: str
    language: str
    n: int  # graded samples (a verdict each)
    correct: int
    format_ok: int
    mean_reward: float | None  # None for HumanEval (graded by its harness, not the reward)
    source: str = ""
    statuses: dict[str, int] = field(default_factory=dict)
    kind: str = ""
    ungradable: int = 0  # samples whose grading failed: in no count above

    @property
    def pass_rate(self) -> float | None:
        return self.correct / self.n if self.n else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pass_rate"] = self.pass_rate
        return d


def problem_language(p: Problem) -> str:
    if p.language:
        return p.language
    from megatron_rl.reward.language import detect

    return detect(p.prompt)[0]


def problem_result(p: Problem, verdicts: list[Verdict], language: str | None = None) -> ProblemResult:
    """A problem's counts over its samples' verdicts; ungradable samples are only counted as such."""
    graded = [v for v in verdicts if v.gradable]
    statuses: dict[str, int] = defaultdict(int)
    for v in verdicts:
        statuses[v.status] += 1
    rewards = [v.reward for v in graded if v.reward is not None]
    return ProblemResult(p.problem_id, language or problem_language(p), len(graded), sum(v.correct for v in graded),
                         sum(v.format_ok for v in graded), sum(rewards) / len(rewards) if rewards else None,
                         str(p.task.get("source", "")), dict(statuses), str(p.task.get("kind", "")),
                         len(verdicts) - len(graded))


def grade_samples(problems: list[Problem], samples: dict[str, list[Completion]],
                  reward: RewardConfig | None = None, workers: int = 2) -> list[ProblemResult]:
    from megatron_rl.data.humaneval import grade as grade_humaneval, is_humaneval
    from megatron_rl.reward.pool import VerifierPool

    reward = reward or RewardConfig()
    he_items, pool_items = [], []
    for p in problems:
        for j, c in enumerate(samples[p.problem_id]):
            (he_items if is_humaneval(p.task) else pool_items).append((p, j, c))
    verdicts: dict[tuple[str, int], Verdict] = {}
    if pool_items:
        results = []
        chunk = max(32, 8 * workers)  # the pool grades a chunk in parallel; the bar moves between chunks
        with VerifierPool(reward, workers=workers) as pool, \
                Progress(len(pool_items), "grading", unit="sample") as bar:
            for at in range(0, len(pool_items), chunk):
                part = pool_items[at:at + chunk]
                results += pool.map([(p.task, c.response, c.num_tokens) for p, _, c in part])
                bar.update(len(part))
        for (p, j, _), r in zip(pool_items, results):
            if r.grading_failed:
                verdicts[(p.problem_id, j)] = Verdict(False, False, None, str(r.status), gradable=False)
                continue
            status = r.details.get("code_status", r.status) if r.format_ok else "format"
            verdicts[(p.problem_id, j)] = Verdict(bool(r.correct), bool(r.format_ok), float(r.total), str(status))
    if he_items:
        with ThreadPoolExecutor(max(1, workers)) as ex, Progress(len(he_items), "grading", unit="sample") as bar:
            def one(item):
                result = grade_humaneval(item[0].task, item[2].response, reward)
                bar.update(1)
                return result

            results = list(ex.map(one, he_items))
        for (p, j, _), r in zip(he_items, results):
            verdicts[(p.problem_id, j)] = Verdict(r.passed, r.status != "no_code", None, r.status,
                                                  gradable=r.gradable)
    return [problem_result(p, [verdicts[(p.problem_id, j)] for j in range(len(samples[p.problem_id]))])
            for p in problems]


def _metrics(rows: list[ProblemResult], ks: list[int]) -> dict[str, Any]:
    graded = [r for r in rows if r.n]
    m: dict[str, Any] = {"problems": len(rows), "samples": sum(r.n for r in rows),
                         "ungradable": sum(r.ungradable for r in rows)}
    if not graded:
        return m
    m["pass@1"] = sum(r.correct / r.n for r in graded) / len(graded)
    for k in ks:
        enough = [r for r in graded if r.n >= k]  # ungradable samples may leave a problem short of k
        if k > 1 and enough:
            m[f"pass@{k}"] = sum(pass_at_k(r.n, r.correct, k) for r in enough) / len(enough)
            if len(enough) < len(rows):
                m[f"problems@{k}"] = len(enough)  # problems in pass@k
    m["format_rate"] = sum(r.format_ok for r in graded) / m["samples"]
    rewards = [r.mean_reward for r in graded if r.mean_reward is not None]
    if rewards:
        m["mean_reward"] = sum(rewards) / len(rewards)
    return m


def _grouped(rows: list[ProblemResult], ks: list[int], attr: str) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[ProblemResult]] = defaultdict(list)
    for r in rows:
        groups[getattr(r, attr)].append(r)
    return {name: _metrics(rs, ks) for name, rs in sorted(groups.items())}


def summarize(rows: list[ProblemResult], ks: list[int]) -> dict[str, Any]:
    """Overall metrics plus `by_kind` and `by_language` (the same metrics per task kind / language)."""
    out = _metrics(rows, ks)
    out["by_kind"] = _grouped(rows, ks, "kind")
    out["by_language"] = _grouped(rows, ks, "language")
    return out
