"""Run metrics: one JSON line per trainer update in RUN_DIR/metrics.jsonl, plus a progress bar.

Lines are flushed as they are written, so a crash loses at most the line being written, and a
resumed run appends to the same file (each line carries its `update` index).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from megatron_rl.records import Rollout

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


def rollout_stats(rollouts: Iterable[Rollout], trainer_version: int) -> dict[str, float]:
    """Reward components, pass rate, lengths and staleness of graded rollouts."""
    rs = list(rollouts)
    if not rs:
        return {}
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
    stale = [trainer_version - v for r in rs for v in r.weight_versions]
    if stale:
        out["staleness/mean"] = sum(stale) / len(stale)
        out["staleness/max"] = float(max(stale))
    out["versions_per_sequence/mean"] = sum(len(set(r.weight_versions)) for r in rs) / n
    return out


class Progress:
    """A one-line progress display on stderr (a bar when stderr is a terminal, lines otherwise)."""

    def __init__(self, total: int, start: int = 0):
        self.total, self.done, self.t0 = total, start, time.time()
        self.tty = sys.stderr.isatty()

    def update(self, done: int, info: dict[str, float]) -> None:
        self.done = done
        elapsed = time.time() - self.t0
        width = 24
        filled = int(width * done / max(1, self.total))
        shown = "  ".join(f"{k}={v:.3g}" for k, v in info.items())
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {elapsed:6.0f}s  {shown}"
        sys.stderr.write(("\r" + line + " " * 4) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
