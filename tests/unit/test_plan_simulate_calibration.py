"""Calibration of the simulator from a run's metrics.jsonl, and the `megatron-rl simulate` command."""
from __future__ import annotations

import json

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.cli.simulate import calibrate_run
from megatron_rl.control.metrics import METRICS_FILE, JsonlWriter
from megatron_rl.plan.simulate import SimParams
from megatron_rl.plan.simulate_calibration import calibrate, fit_line


def metrics_rows(a=2.0, b=1e-3, prompt_len=20, gen_rate=500.0, generators=2, idle=0.25, push=0.7):
    """Rows as Controller._write_metrics writes them, from known rates."""
    rows = []
    for i, (nseq, btok) in enumerate([(32, 3000), (32, 6000), (32, 4500), (32, 9000), (32, 2500)]):
        total = btok + prompt_len * nseq
        t = a + b * total
        rows.append({"update": i + 1, "wall_s": t + push, "train/tokens_per_s": total / t, "batch/tokens": btok,
                     "batch/sequences": nseq, "generator_tokens_per_s": gen_rate * generators * (1 - idle),
                     "generator_idle_frac": idle, "push/wall_s": push, "length/mean": btok / nseq,
                     "groups/completed": 10 * (i + 1), "groups/dropped_non_diverse": 3 * (i + 1)})
    return rows


def test_calibration_recovers_the_rates():
    cal = calibrate(metrics_rows(), generators=2, n_async=64, prompt_len=20, skip=0)
    assert cal.train_a_s == pytest.approx(2.0, rel=1e-9)
    assert cal.train_b_s == pytest.approx(1e-3, rel=1e-9)
    assert cal.push_s == pytest.approx(0.7)
    assert cal.peak_tok_s == pytest.approx(500.0)  # c_half = 0: the busy rate is the peak
    assert cal.drop_prob == pytest.approx(0.3)
    # with a saturation curve the measured rate sits at c = n_async / generators = 32
    cal = calibrate(metrics_rows(), generators=2, n_async=64, prompt_len=20, c_half=32.0, skip=0)
    assert cal.peak_tok_s * 32 / (32 + 32.0) == pytest.approx(500.0)
    p = cal.apply(SimParams())
    assert (p.train_a_s, p.train_b_s, p.push_s, p.decode.c_half) == (cal.train_a_s, cal.train_b_s, 0.7, 32.0)


def test_calibration_of_an_episode_run_takes_its_turns_tool_time_and_model_tokens():
    rows = [r | {"episode/turns": t, "episode/tool_s": 0.9 * t, "episode/env_token_frac": 0.25}
            for r, t in zip(metrics_rows(), [2.8, 3.1, 3.0, 3.2, 2.9])]
    cal = calibrate(rows, generators=2, n_async=64, skip=0)
    assert cal.turns == 3 and cal.tool_s == pytest.approx(0.9)  # seconds per step: one after each turn
    assert cal.mean_length == pytest.approx(0.75 * sum(r["length/mean"] for r in rows) / 5)
    assert (cal.apply(SimParams()).turns, cal.apply(SimParams()).tool_s) == (3, pytest.approx(0.9))
    plain = calibrate(metrics_rows(), generators=2, n_async=64, skip=0)
    assert plain.turns is None and plain.apply(SimParams(turns=2, tool_s=1.0)).turns == 2  # unmeasured: kept


def test_fit_line_falls_back_to_a_rate_when_tokens_barely_vary():
    assert fit_line([1000, 1010], [2.0, 2.02]) == (0.0, pytest.approx(4.02 / 2010))
    assert fit_line([1, 2, 3], [3.0, 5.0, 7.0]) == (pytest.approx(1.0), pytest.approx(2.0))
    with pytest.raises(ValueError):
        fit_line([], [])


def test_calibrate_run_reads_the_controller_file(tmp_path):
    w = JsonlWriter(tmp_path / METRICS_FILE)
    for row in metrics_rows():
        w.write(row)
    w.close()
    cal = calibrate_run(tmp_path, generators=2, n_async=64, prompt_len=20)
    assert cal.rows == 4 and cal.train_b_s == pytest.approx(1e-3)
    with pytest.raises(FileNotFoundError):
        calibrate_run(tmp_path / "nothing", 1, 16)
    with pytest.raises(ValueError, match="nothing to calibrate"):
        calibrate([{"update": 1}, {"update": 2}], 1, 16)


def test_cli_prints_both_modes_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = cli_main(["simulate", "--generators", "2", "--n-async", "64", "--n-batch", "32", "--n-mini", "4",
                   "--group", "8", "--peak-tok-s", "400", "--c-half", "8", "--train-a", "1", "--train-b", "1e-4",
                   "--push-s", "0.2", "--lengths", "pareto:low=40,ratio=5", "--updates", "20", "--warmup", "4",
                   "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "async / sync throughput" in text and text.count("\n") >= 4
    doc = json.loads(out.read_text())
    assert doc["params"]["n_async"] == 64 and doc["params"]["lengths"]["kind"] == "pareto"
    assert doc["async"]["sequences_per_s"] > 0 and doc["sync"]["staleness_max"] == 0
    # episodes: tool steps as long as a turn's decode slow the synchronous round, which waits them out
    shape = ["simulate", "--n-async", "32", "--n-batch", "32", "--n-mini", "1", "--group", "8", "--peak-tok-s",
             "400", "--lengths", "constant:120", "--updates", "8", "--warmup", "2", "--json", str(out)]
    runs = []
    for extra in ([], ["--turns", "3", "--tool-s", "0.5"]):
        assert cli_main(shape + extra) == 0
        runs.append(json.loads(out.read_text()))
    assert (runs[1]["params"]["turns"], runs[1]["params"]["tool_s"]) == (3, 0.5)
    assert runs[1]["sync"]["sequences_per_s"] < runs[0]["sync"]["sequences_per_s"]


def test_cli_calibrated_and_errors(tmp_path, capsys):
    w = JsonlWriter(tmp_path / METRICS_FILE)
    for row in metrics_rows():
        w.write(row)
    w.close()
    assert cli_main(["simulate", "--calibrate", str(tmp_path), "--generators", "2", "--n-async", "64",
                     "--group", "8", "--updates", "12", "--warmup", "2", "--json", "-"]) == 0
    text = capsys.readouterr().out
    doc = json.loads(text[text.index("\n{") + 1:])
    assert doc["params"]["push_s"] == pytest.approx(0.7)
    assert cli_main(["simulate", "--n-batch", "10", "--n-mini", "3"]) == 2
    assert "n_mini" in capsys.readouterr().err
    assert cli_main(["simulate", "--lengths", "bogus:1"]) == 2
