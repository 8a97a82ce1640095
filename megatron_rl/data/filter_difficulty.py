"""Difficulty filtering (Magistral's two stages): keep problems whose pass rate lies in a band.

Stage 1 samples k completions per problem with a first model and keeps problems that are neither
always nor never solved (pass rate in [min_pass, max_pass]); stage 2 re-runs the same filter on the
stage-1 output with a stronger model (the RL checkpoint trained on stage 1) to drop what became
too easy and keep what was out of reach before. Each stage is one call of `difficulty_filter` (one
`megatron-rl filter difficulty` run); rows carry `pass_rate`, `n_samples`, `n_correct`, `stage`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config import RewardConfig
from megatron_rl.evaluation.sampling import Sampler
from megatron_rl.evaluation.scoring import grade_samples
from megatron_rl.records import Problem


@dataclass
class DifficultyReport:
    kept: list[dict[str, Any]] = field(default_factory=list)
    all_rows: list[dict[str, Any]] = field(default_factory=list)
    too_easy: int = 0
    too_hard: int = 0
    ungradable: int = 0  # problems none of whose samples could be graded: neither kept nor dropped as hard

    def summary(self) -> dict[str, Any]:
        out = {"problems": len(self.all_rows), "kept": len(self.kept), "too_easy": self.too_easy,
               "too_hard": self.too_hard}
        return out | ({"ungradable": self.ungradable} if self.ungradable else {})


def problem_row(p: Problem) -> dict[str, Any]:
    """The JSONL form `data.sources.read_jsonl` reads back."""
    row = {"id": p.problem_id, "prompt": p.prompt, "task": p.task}
    if p.language:
        row["lang"] = p.language
    return row


def difficulty_filter(problems: list[Problem], sampler: Sampler, k: int, min_pass: float, max_pass: float,
                      stage: int = 1, reward: RewardConfig | None = None, workers: int = 2) -> DifficultyReport:
    if not 0.0 <= min_pass <= max_pass <= 1.0:
        raise ValueError(f"need 0 <= min_pass <= max_pass <= 1, got {min_pass}, {max_pass}")
    samples = sampler.sample(problems, k)
    results = grade_samples(problems, samples, reward, workers)
    report = DifficultyReport()
    for p, r in zip(problems, results):
        row = problem_row(p)
        row.update(pass_rate=r.pass_rate, n_samples=r.n, n_correct=r.correct, stage=stage)
        report.all_rows.append(row)
        if r.pass_rate is None:
            report.ungradable += 1
        elif r.pass_rate < min_pass:
            report.too_hard += 1
        elif r.pass_rate > max_pass:
            report.too_easy += 1
        else:
            report.kept.append(row)
    return report
