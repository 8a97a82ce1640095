"""Curves: a sample-weighted moving average over faint raw points, integer update ticks, one panel per
quantity (pass rate once), and several runs on one figure (`megatron-rl plot A B -o out.png`)."""
from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest

from megatron_rl.experiments.plot import PANELS, smooth, weight


def _reference(x, y, w, halflife):
    """The weighted moving average written out: every point's weight times 2^(-age / halflife)."""
    x, y, w = map(np.asarray, (x, y, w))
    out = []
    for t in range(len(x)):
        k = w[:t + 1] * 2.0 ** (-(x[t] - x[:t + 1]) / halflife)
        out.append(float((k * y[:t + 1]).sum() / k.sum()))
    return out


def test_smoothing_equals_the_weighted_average_written_out_with_gaps_between_lines():
    rng = random.Random(3)
    x = sorted(rng.sample(range(1, 200), 40))  # lines every few updates (run.log_every, a resumed run)
    y = [rng.uniform(-1, 1) for _ in x]
    w = [rng.choice([2, 16, 64, 128]) for _ in x]
    for halflife in (1.0, 3.5, 20.0):
        assert smooth(x, y, w, halflife) == pytest.approx(_reference(x, y, w, halflife), rel=1e-9, abs=1e-12)


def test_a_line_graded_on_two_samples_makes_no_spike():
    x = list(range(1, 21))
    y = [0.2] * 20
    w = [64.0] * 20
    y[10], w[10] = 1.0, 2.0  # one update whose window graded 2 samples, both correct
    weighted = smooth(x, y, w, halflife=2.0)
    unweighted = smooth(x, y, [1.0] * 20, halflife=2.0)
    assert weighted[10] - weighted[9] < 0.02 * (y[10] - weighted[9])
    assert unweighted[10] - unweighted[9] > 0.2 * (y[10] - unweighted[9])  # what raw lines would show


def test_rollout_metrics_weigh_by_samples_and_trainer_metrics_by_updates():
    row = {"update": 4, "rollouts": 37, "updates_in_line": 2, "reward/mean": 0.5, "train/loss": 0.1}
    assert weight("reward/mean", row) == 37 and weight("pass_rate", row) == 37 and weight("length/mean", row) == 37
    assert weight("train/loss", row) == 2 and weight("train/grad_norm", {"update": 1}) == 1
    drawn = [k for _, keys in PANELS for k in keys]
    assert drawn.count("pass_rate") == 1 and "reward/correct" not in drawn  # pass rate drawn once
    assert "train/entropy" in drawn and "train/grad_norm" in drawn


def _run(path, seed: int, updates: int):
    rng = random.Random(seed)
    path.mkdir()
    with (path / "metrics.jsonl").open("w") as f:
        for u in range(1, updates + 1):
            f.write(json.dumps({"update": u, "rollouts": rng.choice([2, 32]), "updates_in_line": 1,
                                "reward/mean": rng.random(), "pass_rate": rng.random(), "train/loss": rng.random(),
                                "train/entropy": 2 - u / updates, "train/grad_norm": rng.uniform(0.5, 2)}) + "\n")
    return path


def test_two_runs_on_one_figure_with_their_labels_and_integer_update_ticks(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from megatron_rl.cli import plot as command

    saved = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), real_savefig(fig, *a, **k)))
    a, b = _run(tmp_path / "a", 0, 7), _run(tmp_path / "b", 1, 11)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path / "compare.png"
    assert command.main(parser.parse_args([str(a), str(b), "-o", str(out), "--labels", "clip", "no-clip"])) == 0
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[0] > 100
    (fig,) = saved
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {"reward", "pass rate", "loss / clip", "entropy", "grad norm"}  # the panels with data
    for title in ("reward", "pass rate", "entropy", "grad norm"):
        labels = [line.get_label() for line in panels[title].lines]
        assert any(label.startswith("clip") for label in labels) and any(l.startswith("no-clip") for l in labels)
        assert len(panels[title].collections) == len(labels)  # raw points under every smoothed line
        ticks = [t for t in panels[title].get_xticks() if 1 <= t <= 11]
        assert ticks and all(float(t).is_integer() for t in ticks)
    assert command.main(parser.parse_args([str(a), str(b)])) == 2  # several runs need -o


def test_chosen_metrics_get_one_panel_each(tmp_path):
    from megatron_rl.experiments.plot import plot_runs

    a = _run(tmp_path / "a", 0, 5)
    out = plot_runs([a], tmp_path / "one.png", metrics=["reward/mean", "train/*"])
    assert out.stat().st_size > 0


@pytest.mark.parametrize("turns", [1.0, 2.5])
def test_episode_panels_are_drawn_for_multi_turn_runs_only(tmp_path, monkeypatch, turns):
    from matplotlib.figure import Figure

    from megatron_rl.experiments.plot import plot_runs

    saved = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), real_savefig(fig, *a, **k)))
    run = _run(tmp_path / "a", 0, 4)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    episode = {"episode/turns": turns, "episode/tool_calls": turns - 1, "episode/env_token_frac": 0.3,
               "episode/cached_prefix_frac": 0.5, "episode/stop/done": 0.9, "episode/stop/max_turns": 0.1}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r | episode) + "\n" for r in rows))
    plot_runs([run], tmp_path / "out.png")
    titles = {ax.get_title() for ax in saved[0].axes if ax.get_visible()}
    episode_panels = {"episode turns / tool calls", "episode tokens", "episode stops"}
    assert (episode_panels <= titles) if turns > 1 else not (episode_panels & titles)
    if turns > 1:
        (stops,) = [ax for ax in saved[0].axes if ax.get_title() == "episode stops"]
        assert {line.get_label() for line in stops.lines} == {"episode/stop/done", "episode/stop/max_turns"}
