"""Metrics lines: rollout statistics and idle fractions of an update window; JSONL survives a cut line."""
import pytest

from megatron_rl.control.metrics import JsonlWriter, UpdateWindow, read_jsonl
from megatron_rl.records import Rollout


def _rollout(reward, correct, versions, finish="stop"):
    n = len(versions)
    return Rollout("g#1", 0, [1], list(range(n)), [-1.0] * n, versions, finish, reward=reward,
                   reward_components={"format_ok": 1.0, "correct": correct})


def test_window_summary():
    w = UpdateWindow(graded=[_rollout(1.0, 1.0, [3, 3, 4]), _rollout(0.1, 0.0, [4], "length")],
                     gen_idle_s=1.0, gen_busy_s=3.0, trainer_idle_s=0.0)
    row = w.summary(trainer_version=5, train_metrics={"loss": 0.5, "grad_norm": 2.0, "unrelated": 1})
    assert row["reward/mean"] == pytest.approx(0.55) and row["pass_rate"] == pytest.approx(0.5)
    assert row["length/mean"] == 2.0 and row["length/max"] == 3.0 and row["finish/length_frac"] == 0.5
    assert row["staleness/mean"] == pytest.approx((2 + 2 + 1 + 1) / 4) and row["staleness/max"] == 2.0
    assert row["versions_per_sequence/mean"] == 1.5
    assert row["generator_idle_frac"] == 0.25 and row["train/loss"] == 0.5 and "train/unrelated" not in row


def test_jsonl_reader_skips_a_line_cut_by_a_crash(tmp_path):
    path = tmp_path / "m.jsonl"
    w = JsonlWriter(path)
    w.write({"update": 1, "x": float("nan")})
    w.close()
    with path.open("a") as f:
        f.write('{"update": 2, "x"')
    assert read_jsonl(path) == [{"update": 1, "x": None}]


def test_mismatch_metrics_reach_the_line_and_the_curves(tmp_path):
    """The trainer's mismatch/... values go to metrics.jsonl under their own names (a line over two
    updates: max of maxima, mean of means) and are drawn by `megatron-rl plot`."""
    from megatron_rl.config import RunConfig
    from megatron_rl.experiments.plot import PANELS, plot_run

    w = UpdateWindow(graded=[_rollout(1.0, 1.0, [1, 2])])
    run = RunConfig(log_every=2, updates=4)
    first = {"loss": 0.5, "mismatch/lag0/abs_mean": 1e-3, "mismatch/lag0/abs_max": 4e-3, "is_masked_frac": 0.1}
    assert w.line(run, 1, 1, first, {}, {}) is None
    row = w.line(run, 2, 2, {**first, "mismatch/lag0/abs_mean": 3e-3, "mismatch/lag0/abs_max": 2e-3}, {}, {})
    assert row["mismatch/lag0/abs_mean"] == pytest.approx(2e-3) and row["mismatch/lag0/abs_max"] == 4e-3
    assert row["train/is_masked_frac"] == pytest.approx(0.1) and "train/mismatch/lag0/abs_mean" not in row
    assert any("mismatch/lag0/abs_mean" in keys for _, keys in PANELS)
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    writer.write(row)
    writer.close()
    assert plot_run(tmp_path).stat().st_size > 0


@pytest.mark.parametrize("language_check", [True, False])
def test_language_ok_is_logged_only_where_the_language_is_checked(language_check):
    """With reward.language_check false nothing is checked: reward/language_ok must not read 0.0 (a
    failed check); a response that fails the format gate does not bring it back."""
    from megatron_rl.config import RewardConfig
    from megatron_rl.control.grading import apply_verdict
    from megatron_rl.reward import score

    cfg = RewardConfig(language_check=language_check)
    task = {"kind": "math", "answer": "12", "problem": "How many pencils for four dollars at three a dollar?"}
    good = "<think>Three pencils per dollar, four dollars, twelve pencils.</think>\nSo it is $\\boxed{12}$."
    rollouts = [_rollout(None, 0.0, [1]), _rollout(None, 0.0, [1])]
    for rollout, response in zip(rollouts, (good, "no think, no box")):
        breakdown = score(task, response, cfg, num_tokens=20)
        assert breakdown.language_ok is (breakdown.format_ok if language_check else None)
        apply_verdict(rollout, breakdown)
    row = UpdateWindow(graded=rollouts).summary(trainer_version=1, train_metrics={})
    assert row["reward/format_ok"] == 0.5 and row["reward/correct"] == 0.5
    if language_check:
        assert row["reward/language_ok"] == 0.5
    else:
        assert "reward/language_ok" not in row
