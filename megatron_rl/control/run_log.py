"""What a run writes about itself: RUN_DIR/metrics.jsonl (one line per `run.log_every` updates) and
RUN_DIR/groups.jsonl (one event per finished group), and the progress line. Each metrics line also goes
to the other backends of `run.loggers` (loggers.py: TensorBoard, W&B, MLflow) under the same names.

`window` collects the rollout side of the current metrics line (graded samples, idle times, grading
failures); `train`, `batch` and `push` hold the last update's trainer metrics, batch size and push
report until the line is written. See docs/control.md, "Metrics lines".
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable

from megatron_rl.config import RunConfig
from megatron_rl.control.loggers import open_loggers
from megatron_rl.control.metrics import EVENTS_FILE, JsonlWriter, Progress, UpdateWindow
from megatron_rl.sync.messages import PushReport

PROGRESS_KEYS = {"reward/mean": "reward", "pass_rate": "pass", "length/mean": "len", "train/loss": "loss"}


class RunLog:
    def __init__(self, run: RunConfig, run_dir: Path):
        self.run = run
        self.window = UpdateWindow()
        self.record, self.loggers = open_loggers(run, run_dir)  # metrics.jsonl, and the others of run.loggers
        self.metrics = self.record.writer
        self.events = JsonlWriter(run_dir / EVENTS_FILE)
        self.train: dict[str, Any] = {}  # the last update's trainer metrics; empty once its line is written
        self.batch: dict[str, Any] = {}
        self.push: dict[str, Any] = {}
        self._last_row: dict[str, Any] = {}

    def offsets(self) -> dict[str, int]:
        """The size of each log now (every line is flushed as written): saved in a checkpoint, so a
        resume cuts the logs back to it (`cut_back`)."""
        return {"metrics": self.metrics.size(), "groups": self.events.size()}

    def cut_back(self, offsets: dict[str, int]) -> None:
        """On resume: drop what was written after the checkpoint (rows of updates it does not hold,
        events of groups it holds as pending, a line cut by a kill), so nothing is logged twice."""
        for name, writer in (("metrics", self.metrics), ("groups", self.events)):
            size = writer.size()
            if size > offsets[name]:
                os.truncate(writer.path, offsets[name])
            elif size < offsets[name]:
                print(f"megatron-rl train: {writer.path} is shorter than at the checkpoint ({size} < "
                      f"{offsets[name]} bytes); appending to it as it is", file=sys.stderr, flush=True)

    def pushed(self, report: PushReport, wall_s: float) -> None:
        """The last push (`push/*` of the next metrics line): the trainers' report and its wall time."""
        self.push = dict(dataclasses.asdict(report), wall_s=wall_s)

    def group_done(self, event: dict[str, Any]) -> None:
        self.events.write(event)

    def write_line(self, update: int, version: int, state: dict[str, Any],
                   hold: Callable[[dict[str, Any]], bool] | None = None) -> bool:
        """The metrics line of the updates up to `update`, if one is due (run.log_every); `state` adds
        the counters as they are now. True when a line was written; not when `hold` keeps it (an
        evaluation round adds its results, then `write_row`)."""
        row = self.window.line(self.run, update, version, self.train, self.batch, self.push)
        if row is None:
            return False
        row.update(state)
        self.window = UpdateWindow()
        if hold is not None and hold(row):
            return False
        self.write_row(row)
        return True

    def write_row(self, row: dict[str, Any]) -> None:
        self.record.log(row, row["update"])
        for logger in self.loggers:
            logger.log(row, row["update"])
        self._last_row = row

    def show(self, progress: Progress, update: int) -> None:
        row = self._last_row
        progress.update(update, {short: row[k] for k, short in PROGRESS_KEYS.items()
                                 if isinstance(row.get(k), (int, float))})

    def close(self) -> None:
        for logger in [self.record, *self.loggers]:
            logger.close()
        self.events.close()
