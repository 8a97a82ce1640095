"""Run metrics: one JSON line per `run.log_every` trainer updates in RUN_DIR/metrics.jsonl, plus a progress bar.

Lines are flushed as they are written, so a crash loses at most the line being written, and a
resumed run appends to the same file (each line carries its `update` index).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from megatron_rl.algo.distill import PREFIX as DISTILL_PREFIX
from megatron_rl.algo.mismatch import PREFIX as MISMATCH_PREFIX
from megatron_rl.config import LengthStage, RunConfig
from megatron_rl.records import Batch, Rollout

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "groups.jsonl"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class JsonlWriter:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(_clean(row)) + "\n")
        self._f.flush()

    def size(self) -> int:
        """Bytes in the file (lines are flushed as written; O_APPEND writes follow a truncation)."""
        return os.fstat(self._f.fileno()).st_size

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return rows


def episode_stats(rollouts: list[Rollout]) -> dict[str, float | None]:
    """Turns, tools, why episodes stopped, the environment's share of the completion tokens and the
    prefix cache's share of the prompt tokens (every turn's request), over graded episodes."""
    if not rollouts:
        return {}
    n, eps = len(rollouts), [r.episode for r in rollouts]
    prompt = sum(e.prompt_tokens for e in eps)
    tokens = sum(len(r.completion_ids) for r in rollouts)
    row: dict[str, float | None] = {
        "episode/turns": sum(e.turns for e in eps) / n, "episode/tool_calls": sum(e.tool_calls for e in eps) / n,
        "episode/tool_errors": sum(e.tool_errors for e in eps), "episode/tool_timeouts": sum(e.tool_timeouts for e in eps),
        "episode/tool_s": sum(e.tool_s for e in eps) / n,
        # turns a resume took from a checkpoint instead of sampling again; episodes it had to start over
        "episode/resumed_turns": sum(e.resumed_turns for e in eps),
        "episode/replay_diverged": sum(e.replay_diverged for e in eps),
        "episode/env_token_frac": sum(e.env_tokens for e in eps) / tokens if tokens else 0.0,
        "episode/cached_prefix_frac": sum(e.cached_tokens for e in eps) / prompt if prompt else None}
    for stop in sorted({e.stop for e in eps}):
        row[f"episode/stop/{stop}"] = sum(e.stop == stop for e in eps) / n
    return row


def rollout_stats(rollouts: Iterable[Rollout], trainer_version: int) -> dict[str, float]:
    """Reward components, pass rate, lengths and staleness of graded rollouts."""
    rs = list(rollouts)
    if not rs:  # a window in which nothing was graded (e.g. while a generator restarted)
        return {"rollouts": 0.0}
    n = len(rs)
    out: dict[str, float] = {"rollouts": float(n)}
    keys = sorted({k for r in rs for k in r.reward_components})
    for k in keys:
        out[f"reward/{k}"] = sum(r.reward_components.get(k, 0.0) for r in rs) / n
    out["reward/mean"] = sum(float(r.reward or 0.0) for r in rs) / n
    out["pass_rate"] = sum(r.reward_components.get("correct", 0.0) for r in rs) / n
    lengths = [len(r.completion_ids) for r in rs]
    out["length/mean"] = sum(lengths) / n
    out["length/max"] = float(max(lengths))
    out["finish/length_frac"] = sum(r.finish_reason == "length" for r in rs) / n
    stages = [r.stage for r in rs if r.stage is not None]
    if stages:  # the length stages these rollouts were requested under (a mix across a switch)
        out["length/cap_mean"] = sum(s.max_new_tokens for s in stages) / len(stages)
        out["length/l_max_mean"] = sum(s.l_max for s in stages) / len(stages)
    stale = [trainer_version - v for r in rs for v in r.model_versions]  # environment tokens have no version
    if stale:
        out["staleness/mean"] = sum(stale) / len(stale)
        out["staleness/max"] = float(max(stale))
    out["versions_per_sequence/mean"] = sum(len(set(r.model_versions)) for r in rs) / n
    return out


def batch_stats(batch: Batch) -> dict[str, float]:
    """Size of a trained batch and the staleness of its tokens (policy version - the version that
    sampled each token, as the loss sees it): mean over the batch's tokens, the smallest (< 0 would be a
    token newer than the trainer) and the largest; with routing
    replay, the bytes of its routed experts."""
    seqs = batch.sequences
    lags = [batch.policy_version - v for s in seqs for v in s.model_versions]
    out = {"batch/sequences": len(seqs), "batch/tokens": sum(s.completion_len for s in seqs),
           "batch/loss_tokens": sum(s.n_loss_tokens for s in seqs)}
    if lags:
        out |= {"batch/staleness_mean": sum(lags) / len(lags), "batch/staleness_min": min(lags),
                "batch/staleness_max": max(lags)}
    routes = [len(s.routed_experts.ids) for s in seqs if s.routed_experts is not None]
    if routes:  # routing replay: host memory the batch's routes take (records.RoutedExperts)
        out["batch/routed_experts_bytes"] = sum(routes)
    return out


def stage_metrics(stage: LengthStage) -> dict[str, int]:
    """The length stage in force for new requests (cap and overlong-penalty window)."""
    return {"max_new_tokens": stage.max_new_tokens, "stage/start": stage.start, "stage/l_max": stage.l_max,
            "stage/l_cache": stage.l_cache}


# trainer values a line carries under their own names: the mismatch (algo.mismatch), the teacher (algo.distill)
OWN_NAME_PREFIXES = (MISMATCH_PREFIX, DISTILL_PREFIX)
TRAIN_KEYS = ("loss", "loss_tokens", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max", "entropy",
              "grad_norm", "tokens_per_s", "padding_fraction", "shared_prompt_fraction", "is_weight_mean",
              "is_masked_frac", "routing_agreement")


def train_values(train_metrics: dict[str, Any]) -> dict[str, Any]:
    """The trainer's values a metrics line keeps: TRAIN_KEYS, the trainer/generator mismatch
    (`mismatch/lag<k>/...`, algo.mismatch) and the distillation teacher's (`distill/...`), which the line
    carries under their own names."""
    return {k: v for k, v in train_metrics.items() if k in TRAIN_KEYS or k.startswith(OWN_NAME_PREFIXES)}


@dataclass
class UpdateWindow:
    """What happened since the previous metrics line (over `run.log_every` updates), summarised into one."""

    graded: list[Rollout] = field(default_factory=list)  # verdicts only: failed gradings are not rewards
    grading_failed: Counter = field(default_factory=Counter)  # failed grading attempts by status
    regraded: int = 0  # of those, how many were sent to be graded again
    env_failed: int = 0  # episodes whose environment failed (their groups dropped)
    gen_idle_s: float = 0.0
    gen_busy_s: float = 0.0
    trainer_idle_s: float = 0.0
    in_flight_peak: int = 0  # most training samples in flight at once (above n_async: env.extra_in_flight)
    t0: float = field(default_factory=time.time)
    per_update: list[tuple[dict, dict]] = field(default_factory=list)  # (train, batch and push) of each update

    def summary(self, trainer_version: int, train_metrics: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        wall = max(1e-9, now - self.t0)
        row: dict[str, Any] = {"time": now, "wall_s": wall}
        row.update(rollout_stats(self.graded, trainer_version))
        row["grading/failed"] = sum(self.grading_failed.values())
        row.update({f"grading/failed/{status}": n for status, n in sorted(self.grading_failed.items())})
        row["grading/regraded"] = self.regraded
        row.update(episode_stats(self.graded))
        row["episode/env_failed"] = self.env_failed
        row["in_flight_peak"] = self.in_flight_peak
        row.update({k if k.startswith(OWN_NAME_PREFIXES) else f"train/{k}": v
                    for k, v in train_values(train_metrics).items()})
        gen_total = self.gen_idle_s + self.gen_busy_s
        row["generator_idle_frac"] = self.gen_idle_s / gen_total if gen_total else None
        row["trainer_idle_frac"] = min(1.0, self.trainer_idle_s / wall)
        row["generator_tokens_per_s"] = sum(len(r.completion_ids) for r in self.graded) / wall
        return row

    def line(self, run: RunConfig, update: int, version: int, train_metrics: dict[str, Any],
             batch_stats: dict[str, Any], push_report: dict[str, Any]) -> dict[str, Any] | None:
        """Close trainer update `update` in the window with its own values (no train_metrics: none to close,
        the run stops) and return the window's metrics line when one is due: every run.log_every updates,
        at run.updates, and when the run stops with updates since the previous line. Rollout statistics
        and idle fractions cover the whole window; per-update values are merged by `merge_updates`."""
        if train_metrics:
            self.per_update.append((train_values(train_metrics),
                                    {**batch_stats, **{f"push/{k}": v for k, v in push_report.items()}}))
        if not self.per_update or (train_metrics and update % run.log_every and update < run.updates):
            return None
        row = {"update": update, "version": version}
        row.update(self.summary(version, merge_updates([train for train, _ in self.per_update])))
        row.update(merge_updates([own for _, own in self.per_update]))
        row["updates_in_line"] = len(self.per_update)
        return row


def merge_updates(values: list[dict[str, Any]]) -> dict[str, Any]:
    """One value per key for a line that covers several updates: the mean over the updates that report
    the key, the min of `*_min` and the max of `*_max` keys, the last of a `version` or a non-number."""
    if len(values) == 1:
        return dict(values[0])
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for v in values for k in v):
        xs = [v[key] for v in values if key in v]
        if key.endswith("version") or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs):
            out[key] = xs[-1]
        else:
            out[key] = min(xs) if key.endswith("_min") else max(xs) if key.endswith("_max") else sum(xs) / len(xs)
    return out


class Progress:
    """A one-line progress display on stderr (a bar when stderr is a terminal, lines otherwise)."""

    def __init__(self, total: int, start: int = 0):
        self.total, self.done, self.start, self.t0 = total, start, start, time.time()
        self.tty = sys.stderr.isatty()

    def update(self, done: int, info: dict[str, float]) -> None:
        from megatron_rl.progress import eta_text, quiet

        self.done = done
        if quiet():  # --quiet: metrics.jsonl and the loggers only
            return
        elapsed = time.time() - self.t0
        eta = eta_text(done - self.start, self.total - self.start, elapsed)  # from this start's own pace
        width = 24
        filled = int(width * done / max(1, self.total))
        shown = "  ".join(f"{k}={v:.3g}" for k, v in info.items())
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {elapsed:6.0f}s {eta}  {shown}"
        sys.stderr.write(("\r" + line + " " * 4) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
