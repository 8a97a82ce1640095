"""The difference of held-out pass@1 between two evaluation rounds, with a confidence interval.

Both rounds sample the same problems, so they pair by problem: per problem i, d_i = (its pass rate in
the later round) - (in the earlier one), each rate c / n over that round's graded samples. The mean of
the d_i is the difference of pass@1 (over the problems graded in both rounds), and the interval is the
normal approximation of a paired mean: mean(d) +- z * sd(d) / sqrt(m), sd with the m - 1 denominator,
z the standard normal quantile of the level (1.96 at 95%). Pairing removes the spread of difficulty
between problems, which dominates the unpaired interval; the d_i are independent across problems
(each problem's samples are drawn afresh in each round), which is all the approximation needs, with m
large enough for the mean to be normal (tens of problems; the demo evaluates 157).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence


@dataclass(frozen=True)
class PairedDifference:
    before: float  # pass@1 of the earlier round over the paired problems
    after: float
    low: float  # interval of after - before
    high: float
    problems: int  # problems graded in both rounds
    level: float

    @property
    def difference(self) -> float:
        return self.after - self.before


def paired_difference(before_correct: Sequence[int], before_graded: Sequence[int], after_correct: Sequence[int],
                      after_graded: Sequence[int], level: float = 0.95) -> PairedDifference:
    """Per-problem counts of two rounds over the same problems in the same order (a round's
    `eval/correct_by_problem` and `eval/graded_by_problem`); problems without a graded sample in either
    round are left out."""
    if not len(before_correct) == len(before_graded) == len(after_correct) == len(after_graded):
        raise ValueError("the two rounds must list the same problems (equal lengths)")
    pairs = [(cb / nb, ca / na) for cb, nb, ca, na in zip(before_correct, before_graded, after_correct, after_graded)
             if nb and na]
    m = len(pairs)
    if m < 2:
        raise ValueError(f"{m} problem(s) graded in both rounds: an interval needs at least 2")
    d = [a - b for b, a in pairs]
    mean = sum(d) / m
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (m - 1))
    half = NormalDist().inv_cdf(0.5 + level / 2) * sd / math.sqrt(m)
    before = sum(b for b, _ in pairs) / m
    return PairedDifference(before, before + mean, mean - half, mean + half, m, level)
