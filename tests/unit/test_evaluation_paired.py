"""The paired interval of a held-out difference (evaluation/paired.py): a worked example by hand, a
paired bootstrap (an independent method) on a demo-sized set, and the coverage the 95% interval
promises, on simulated rounds whose true per-problem pass rates are known."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_rl.evaluation.paired import paired_difference


def test_worked_example():
    # pass rates before 1, 1/2, 0, 1/4 and after 1, 1, 1/2, 1/4 (4 samples each; the 4th problem had 4 graded)
    got = paired_difference([4, 2, 0, 1], [4, 4, 4, 4], [2, 4, 2, 1], [2, 4, 4, 4])
    # d = 0, 1/2, 1/2, 0: mean 1/4, sd = sqrt(4 * (1/4)^2 / 3) = 0.288675, half = 1.959964 * sd / 2
    assert (got.before, got.after, got.problems) == (pytest.approx(0.4375), pytest.approx(0.6875), 4)
    assert got.difference == pytest.approx(0.25)
    assert (got.low, got.high) == (pytest.approx(0.25 - 0.282896, abs=1e-6), pytest.approx(0.25 + 0.282896, abs=1e-6))


def test_problems_without_a_graded_sample_are_left_out_and_shapes_must_agree():
    got = paired_difference([1, 0, 3], [2, 0, 4], [2, 1, 3], [2, 4, 4])
    assert got.problems == 2 and got.difference == pytest.approx(0.25)
    with pytest.raises(ValueError, match="same problems"):
        paired_difference([1], [2], [1, 1], [2, 2])
    with pytest.raises(ValueError, match="at least 2"):
        paired_difference([1, 1], [2, 0], [1, 1], [2, 2])


def _round(rates: torch.Tensor, k: int, gen: torch.Generator) -> list[int]:
    return (torch.rand(len(rates), k, generator=gen) < rates[:, None]).sum(1).tolist()


def test_agrees_with_a_paired_bootstrap():
    gen = torch.Generator().manual_seed(0)
    m, k = 157, 4
    before_rates = torch.rand(m, generator=gen)
    after_rates = (before_rates + 0.1).clamp(max=1.0)
    before, after = _round(before_rates, k, gen), _round(after_rates, k, gen)
    got = paired_difference(before, [k] * m, after, [k] * m)
    rng = random.Random(1)
    d = [(a - b) / k for a, b in zip(after, before)]
    means = sorted(sum(d[rng.randrange(m)] for _ in range(m)) / m for _ in range(4000))
    low, high = means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]
    width = got.high - got.low
    assert got.low == pytest.approx(low, abs=0.06 * width) and got.high == pytest.approx(high, abs=0.06 * width)


def test_95_percent_interval_covers_the_true_difference_95_percent_of_the_time():
    gen = torch.Generator().manual_seed(2)
    m, k, trials = 157, 2, 2000
    before_rates = torch.rand(m, generator=gen)
    after_rates = (before_rates + 0.2 * torch.rand(m, generator=gen) - 0.05).clamp(0.0, 1.0)
    truth = float((after_rates - before_rates).mean())
    covered = 0
    for _ in range(trials):
        r = paired_difference(_round(before_rates, k, gen), [k] * m, _round(after_rates, k, gen), [k] * m)
        covered += r.low <= truth <= r.high
    # binomial sd of the coverage over 2000 trials: 0.005; the band is 3 of them each side
    assert 0.935 <= covered / trials <= 0.965
