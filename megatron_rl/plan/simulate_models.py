"""Inputs of the pipeline simulator (`plan/simulate.py`): generator decode throughput as a
function of concurrency, and completion-length distributions (incl. heavy-tailed ones)."""
from __future__ import annotations

import math
import random
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Literal


@dataclass
class DecodeModel:
    """Tokens/s of one generator as a function of its concurrent sequences."""

    peak_tok_s: float = 1000.0
    c_half: float = 0.0  # concurrency at which half the peak is reached (0: constant throughput)
    table: list[tuple[float, float]] | None = None  # measured (concurrency, tok/s), interpolated

    def __post_init__(self) -> None:
        if self.table:
            self.table = sorted((float(c), float(t)) for c, t in self.table)
            if any(c <= 0 or t <= 0 for c, t in self.table):
                raise ValueError(f"decode table entries must be positive (concurrency, tok/s): {self.table}")
        elif self.peak_tok_s <= 0 or self.c_half < 0:
            raise ValueError(f"need peak_tok_s > 0 and c_half >= 0, got {self.peak_tok_s}, {self.c_half}")

    def tok_s(self, c: int) -> float:
        if c <= 0:
            return 0.0
        if not self.table:
            return self.peak_tok_s * c / (c + self.c_half)
        cs = [p[0] for p in self.table]
        i = bisect_left(cs, c)
        if i == 0:  # below the first point: proportional to c (one sequence cannot go faster)
            return self.table[0][1] * min(1.0, c / cs[0])
        if i == len(cs):
            return self.table[-1][1]
        (c0, t0), (c1, t1) = self.table[i - 1], self.table[i]
        return t0 + (t1 - t0) * (c - c0) / (c1 - c0)


@dataclass
class LengthDist:
    """Completion lengths (tokens, >= 1)."""

    kind: Literal["constant", "lognormal", "pareto", "uniform", "empirical"] = "lognormal"
    mean: float = 1000.0  # constant: the length; lognormal: its mean
    sigma: float = 0.5  # lognormal: sigma of log-length
    low: float = 200.0  # pareto/uniform: shortest length
    ratio: float = 5.0  # pareto/uniform: longest / shortest
    alpha: float = 1.2  # pareto: tail index of the bounded Pareto on [low, low * ratio]
    values: list[int] = field(default_factory=list)  # empirical: drawn uniformly
    max_len: int | None = None  # cap (max_new_tokens)

    def __post_init__(self) -> None:
        ok = {"constant": self.mean >= 1, "lognormal": self.mean >= 1 and self.sigma >= 0,
              "pareto": self.low >= 1 and self.ratio >= 1 and self.alpha > 0,
              "uniform": self.low >= 1 and self.ratio >= 1,
              "empirical": bool(self.values) and all(int(v) >= 1 for v in self.values)}
        if self.kind not in ok:
            raise ValueError(f"unknown length distribution {self.kind!r}; one of {sorted(ok)}")
        if not ok[self.kind]:
            raise ValueError(f"invalid parameters for the {self.kind} length distribution: {self}")

    def sampler(self, rng: random.Random) -> Callable[[], int]:
        k, cap = self.kind, self.max_len or 10 ** 9
        if k == "constant":
            draw = lambda: self.mean  # noqa: E731
        elif k == "lognormal":
            mu = math.log(self.mean) - self.sigma ** 2 / 2  # so that E[length] = mean
            draw = lambda: rng.lognormvariate(mu, self.sigma)  # noqa: E731
        elif k == "uniform":
            draw = lambda: rng.uniform(self.low, self.low * self.ratio)  # noqa: E731
        elif k == "pareto":  # inverse CDF of the Pareto(alpha) truncated to [low, high]
            lo, hi, a = self.low, self.low * self.ratio, self.alpha
            tail = 1 - (lo / hi) ** a
            draw = lambda: lo / (1 - rng.random() * tail) ** (1 / a)  # noqa: E731
        else:
            draw = lambda: rng.choice(self.values)  # noqa: E731
        return lambda: max(1, min(cap, int(round(draw()))))


def parse_lengths(spec: str) -> LengthDist:
    """'constant:500', 'lognormal:mean=1000,sigma=0.6', 'pareto:low=200,ratio=5,alpha=1.2',
    'uniform:low=100,ratio=5', 'empirical:120,340,999' (a `max_len=N` key caps any of them)."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind == "empirical":
        return LengthDist("empirical", values=[int(v) for v in rest.split(",") if v.strip()])
    if kind == "constant" and rest and "=" not in rest:
        return LengthDist("constant", mean=float(rest))
    kw: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in ("mean", "sigma", "low", "ratio", "alpha", "max_len"):
            raise ValueError(f"bad length spec item {item!r} in {spec!r} (keys: mean sigma low ratio alpha max_len)")
        kw[key] = float(value)
    if "max_len" in kw:
        kw["max_len"] = int(kw["max_len"])
    return LengthDist(kind, **kw)  # type: ignore[arg-type]
