"""Progress with an ETA: a tqdm bar on a terminal, sparse INFO lines in a log file, nothing with
--quiet; the training line's ETA from this start's own pace (a resumed run does not count the
updates it inherited)."""
from __future__ import annotations

import io
import logging
import sys

import pytest

from megatron_rl.control.metrics import Progress as TrainingLine
from megatron_rl.progress import QUIET_ENV, CountingMapping, Progress, eta_text


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_eta_is_the_remaining_work_at_the_pace_so_far():
    assert eta_text(5, 10, 50.0) == "ETA 00:50"  # 10 s per unit, 5 left
    assert eta_text(1, 100, 3600.0) == "ETA 99:00:00"  # an hour per unit, 99 left
    assert eta_text(0, 10, 5.0) == "ETA ?" and eta_text(3, None, 5.0) == "ETA ?"


def test_a_terminal_gets_a_bar_and_a_log_file_a_line_per_tenth(monkeypatch, caplog):
    monkeypatch.delenv(QUIET_ENV, raising=False)
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with Progress(4, "grading", unit="sample") as bar:
        for _ in range(4):
            bar.update(1)
    assert "grading" in term.getvalue() and "4/4" in term.getvalue()  # tqdm's bar, drawn on the terminal
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar, log lines instead
    with caplog.at_level(logging.INFO, logger="megatron_rl.progress"), Progress(100, "sampling") as bar:
        for _ in range(100):
            bar.update(1)
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rl.progress"]
    assert len(lines) == 10 and lines[-1].startswith("sampling: 100/100") and "ETA" in lines[0], lines
    assert "\r" not in sys.stderr.getvalue()


def test_a_postfix_shows_movement_between_units(monkeypatch, caplog):
    """Evaluate's completions can all take minutes: the tokens streamed meanwhile go on the bar at once,
    and into a log file as a line every LOG_EVERY_S (it printed nothing for 10 minutes before)."""
    from megatron_rl import progress

    monkeypatch.delenv(QUIET_ENV, raising=False)
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with Progress(4, "sampling", unit="completion") as bar:
        bar.set_postfix("120 tokens, 60 tok/s")
    assert "0/4" in term.getvalue() and "120 tokens, 60 tok/s" in term.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.INFO, logger="megatron_rl.progress"), Progress(4, "sampling") as bar:
        for t in range(0, 95, 1):  # a tick a second, no completion done
            now[0] = float(t)
            bar.set_postfix(f"{t * 10} tokens")
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rl.progress"]
    assert lines == [f"sampling: 0/4 it ({t} s, ETA ?), {t * 10} tokens" for t in (30, 60, 90)], lines


def test_quiet_shows_nothing(monkeypatch, caplog):
    monkeypatch.setenv(QUIET_ENV, "1")
    for stream in (Terminal(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", stream)
        with caplog.at_level(logging.INFO, logger="megatron_rl.progress"), Progress(10, "x") as bar:
            bar.update(10)
        line = TrainingLine(5)
        line.update(1, {"reward": 0.5})
        assert stream.getvalue() == "" and not caplog.records


def test_the_training_line_shows_an_eta_from_this_starts_pace(monkeypatch):
    monkeypatch.delenv(QUIET_ENV, raising=False)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    clock = iter([1000.0, 1030.0])  # created at t=1000, update 12 done at t=1030
    monkeypatch.setattr("megatron_rl.control.metrics.time.time", lambda: next(clock))
    line = TrainingLine(20, start=10)  # resumed at update 10 of 20
    line.update(12, {"reward": 0.25})
    # 2 updates in 30 s since this start: 8 left take 120 s (the 10 inherited updates do not count)
    assert "12/20" in err.getvalue() and "ETA 02:00" in err.getvalue() and "reward=0.25" in err.getvalue()


def test_counting_mapping_reads_through_and_counts(monkeypatch):
    monkeypatch.setenv(QUIET_ENV, "1")
    bar = Progress(2, "reading")
    view = CountingMapping({"a": 1, "b": 2}, bar)
    assert dict(view) == {"a": 1, "b": 2} and len(view) == 2 and bar.done == 2
    with pytest.raises(KeyError):
        view["c"]
