"""Fit the simulator's rates to a run: the rows of RUN_DIR/metrics.jsonl as written by `Controller._write_metrics`
(`megatron-rl simulate --calibrate RUN_DIR` reads them: this package does not read the runtime's files).

Per metrics row (one trainer update):
- trainer: the update took `tokens / train/tokens_per_s` seconds, tokens = completion tokens
  (`batch/tokens`) + prompt tokens (`prompt_len * batch/sequences`; the trainer's rate counts both).
  A least-squares line `t = a + b * tokens` over the rows when their token counts differ enough,
  else `a = 0` and `b` = total time / total tokens;
- generators: `generator_tokens_per_s` is over all generators and wall time; divided by the busy
  fraction (1 - `generator_idle_frac`) and the generator count it is one generator's rate at its
  mean concurrency n_async / generators, which fixes `peak` of `peak * c / (c + c_half)` for a
  given `c_half` (not identifiable from these rows: pass a measured one);
- push: `push/wall_s`; lengths: `length/mean`, less its environment tokens (`episode/env_token_frac`):
  the simulator decodes only the model's; non-diverse drop probability: cumulative
  `groups/dropped_non_diverse` / `groups/completed` of the last row;
- episodes: turns = the mean `episode/turns` rounded, tool_s = `episode/tool_s` (environment seconds
  per episode) / turns: one step after each turn.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any, Iterable

from megatron_rl.plan.simulate import DecodeModel, SimParams


@dataclass
class Calibration:
    train_a_s: float
    train_b_s: float
    push_s: float | None
    peak_tok_s: float | None  # one generator at full c_half-adjusted peak
    c_half: float
    mean_length: float | None
    drop_prob: float | None
    rows: int
    turns: int | None = None
    tool_s: float | None = None

    def apply(self, params: SimParams) -> SimParams:
        """`params` with every fitted rate replaced (what was not measured is kept)."""
        out = replace(params, train_a_s=self.train_a_s, train_b_s=self.train_b_s, train_step_s=0.0)
        if self.push_s is not None:
            out = replace(out, push_s=self.push_s)
        if self.peak_tok_s is not None:
            out = replace(out, decode=DecodeModel(self.peak_tok_s, self.c_half))
        if self.drop_prob is not None:
            out = replace(out, drop_prob=min(self.drop_prob, 0.99))
        if self.turns is not None:
            out = replace(out, turns=self.turns, tool_s=self.tool_s or 0.0)
        return out


def fit_line(xs: list[float], ys: list[float], min_spread: float = 0.2) -> tuple[float, float]:
    """y = a + b x by least squares, with a >= 0; through the origin when x barely varies."""
    if not xs or len(xs) != len(ys):
        raise ValueError("fit_line needs equally many (>= 1) x and y values")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if len(xs) >= 2 and mx > 0 and (max(xs) - min(xs)) / mx >= min_spread and sxx > 0:
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        a = my - b * mx
        if a >= 0 and b > 0:
            return a, b
    return 0.0, sum(ys) / sum(xs)


def _num(row: dict[str, Any], key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and v == v else None


def calibrate(rows: Iterable[dict[str, Any]], generators: int, n_async: int, prompt_len: int = 0,
              c_half: float = 0.0, skip: int = 1) -> Calibration:
    """Fit rates from metrics rows; the first `skip` rows (start-up transient) are ignored."""
    if generators < 1 or n_async < 1:
        raise ValueError("generators and n_async must be >= 1")
    rows = list(rows)[skip:]
    tokens, times, gen_rates, pushes, lengths, turns, tool_s = [], [], [], [], [], [], []
    for r in rows:
        tps, btok, nseq = _num(r, "train/tokens_per_s"), _num(r, "batch/tokens"), _num(r, "batch/sequences")
        if tps and btok:
            tok = btok + prompt_len * (nseq or 0.0)
            tokens.append(tok)
            times.append(tok / tps)
        gen, idle = _num(r, "generator_tokens_per_s"), _num(r, "generator_idle_frac")
        if gen:
            busy = 1.0 - (idle or 0.0)
            if busy > 0.05:
                gen_rates.append(gen / busy / generators)
        if (p := _num(r, "push/wall_s")) is not None:
            pushes.append(p)
        if (m := _num(r, "length/mean")) is not None:
            lengths.append(m * (1.0 - (_num(r, "episode/env_token_frac") or 0.0)))
        if (t := _num(r, "episode/turns")) is not None:
            turns.append(t)
            tool_s.append((_num(r, "episode/tool_s") or 0.0) / t)
    if not tokens:
        raise ValueError("no metrics row has train/tokens_per_s and batch/tokens: nothing to calibrate")
    a, b = fit_line(tokens, times)
    peak = None
    if gen_rates:
        c = n_async / generators
        peak = statistics.median(gen_rates) * (c + c_half) / c
    drop = None
    if rows:
        done, nd = _num(rows[-1], "groups/completed"), _num(rows[-1], "groups/dropped_non_diverse")
        if done:
            drop = (nd or 0.0) / done
    return Calibration(a, b, statistics.median(pushes) if pushes else None, peak, c_half,
                       statistics.fmean(lengths) if lengths else None, drop, len(rows),
                       max(1, round(statistics.fmean(turns))) if turns else None,
                       statistics.fmean(tool_s) if tool_s else None)

