"""Progress with an ETA for the long commands (evaluate, filter, translate, convert) and the training line.

On a terminal: a tqdm bar on stderr (log lines print above it, see megatron_rl.log). Not on a terminal
(a batch job's log file): no bar and no carriage returns; an INFO log line at most every tenth of the
work instead, with its rate and ETA, so a log stays readable. `--quiet` (MEGATRON_RL_QUIET=1, which the
command exports to the processes it starts) turns both off.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Mapping

from megatron_rl.log import get_logger

QUIET_ENV = "MEGATRON_RL_QUIET"
LOG_EVERY_S = 30.0  # without a total, how often a log line says how far it got
log = get_logger(__name__)


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def eta_text(done: float, total: float | None, elapsed_s: float) -> str:
    """`ETA 1:23:45` from the rate so far; `ETA ?` before the first unit of work or without a total."""
    if not total or done <= 0 or elapsed_s <= 0:
        return "ETA ?"
    seconds = max(0.0, (total - done) * elapsed_s / done)
    h, rest = divmod(int(seconds + 0.5), 3600)
    return f"ETA {h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"ETA {rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """`with Progress(total, "grading", unit="sample") as p: ... p.update(n)`; a no-op when quiet.
    `set_postfix(text)` shows what moves between units (tokens streamed while completions run): on the
    bar at once, in a log file as a line at most every LOG_EVERY_S."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", *, enabled: bool = True,
                 unit_scale: bool = False):
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.done, self.t0 = 0, time.monotonic()
        self.postfix, self._last_line = "", 0.0  # elapsed seconds at the last log line
        on = enabled and not quiet()
        self._bar = None
        self._log_lines = on and not sys.stderr.isatty()
        self._next_log = self._step()
        if on and not self._log_lines:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr,
                             dynamic_ncols=True, leave=True)

    def _step(self) -> float:
        return max(1.0, self.total / 10) if self.total else LOG_EVERY_S

    def update(self, n: float = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._log_lines:
            elapsed = time.monotonic() - self.t0
            if self.total:  # a line per tenth of the work, and the last one
                if self.done < self._next_log and self.done != self.total:
                    return
                self._next_log = self.done + self._step()
            elif elapsed < self._next_log:  # no total: a line every LOG_EVERY_S seconds
                return
            else:
                self._next_log = elapsed + LOG_EVERY_S
            self._log_line(elapsed)

    def set_postfix(self, text: str) -> None:
        self.postfix = text
        if self._bar is not None:
            self._bar.set_postfix_str(text)
        elif self._log_lines:
            elapsed = time.monotonic() - self.t0
            if elapsed >= self._last_line + LOG_EVERY_S:
                self._log_line(elapsed)

    def _log_line(self, elapsed: float) -> None:
        self._last_line = elapsed
        size = self._size
        of = f"/{size(self.total)}" if self.total else ""
        log.info("%s: %s%s %s (%.0f s, %s)%s", self.desc, size(self.done), of, self.unit, elapsed,
                 eta_text(self.done, self.total, elapsed), f", {self.postfix}" if self.postfix else "")

    def _size(self, n: float) -> str:
        if not self.unit_scale:
            return f"{n:g}"
        from tqdm import tqdm

        return tqdm.format_sizeof(n)  # 486144 -> 486k, as the bar shows it

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CountingMapping(Mapping):
    """A read-only view of `tensors` that counts each item read on `progress` (the HF -> Megatron load
    reads every source tensor once by name)."""

    def __init__(self, tensors: Mapping, progress: Progress):
        self._tensors, self._progress = tensors, progress

    def __getitem__(self, name):
        value = self._tensors[name]
        self._progress.update(1)
        return value

    def __iter__(self) -> Iterator:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
