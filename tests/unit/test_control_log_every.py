"""run.log_every: metrics.jsonl gets one line per log_every updates, the final update's line and, at a stop,
one for the updates since the previous line; each line summarises its whole window of updates."""
import pytest

from megatron_rl.config import config_from_dict
from megatron_rl.control.controller import Controller
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.metrics import METRICS_FILE, UpdateWindow, merge_updates, read_jsonl
from megatron_rl.records import Problem, Rollout


def _rollout(reward: float, correct: float, length: int = 2) -> Rollout:
    return Rollout("g#1", 0, [1], [5] * length, [-1.0] * length, [0] * length, "stop", reward=reward,
                   reward_components={"format_ok": 1.0, "correct": correct})


def _controller(tmp_path, updates: int, log_every: int) -> Controller:
    """A controller without MPI, generators or graders: only its metrics path is driven."""
    cfg = config_from_dict({"run": {"output_dir": str(tmp_path), "updates": updates, "log_every": log_every},
                            "data": {"source": "jsonl", "path": "unused.jsonl"}})
    return Controller(None, cfg, RankLayout(1, 1, 1), tmp_path, [Problem("p", "q", {"kind": "math"})], None)


def _update(ctrl: Controller, u: int, rollouts: list[Rollout]) -> None:
    """What the controller records for trainer update `u`, then its call once the weights are pushed."""
    ctrl.log.window.graded += rollouts
    ctrl.updates_done, ctrl.version = u, u
    ctrl.log.train = {"version": u, "loss": float(u), "ratio_min": 1.0 - u / 10, "ratio_max": 1.0 + u / 10}
    ctrl.log.batch = {"batch/sequences": 2 * u, "batch/tokens": 10 * u}
    ctrl.log.push = {"version": u, "bytes": 100 * u}
    ctrl._write_metrics()
    ctrl.log.train = {}


def _rows(ctrl: Controller, tmp_path) -> list[dict]:
    ctrl.log.close()
    return read_jsonl(tmp_path / METRICS_FILE)


def test_five_updates_every_two_give_lines_for_2_4_and_the_final_5(tmp_path):
    ctrl = _controller(tmp_path, updates=5, log_every=2)
    graded = {1: [_rollout(1.0, 1.0)], 2: [_rollout(0.0, 0.0), _rollout(0.0, 0.0)], 3: [], 4: [_rollout(0.5, 1.0)],
              5: [_rollout(1.0, 1.0, length=4)]}
    for u in range(1, 6):
        _update(ctrl, u, graded[u])
    rows = _rows(ctrl, tmp_path)
    assert [r["update"] for r in rows] == [2, 4, 5]
    assert [r["updates_in_line"] for r in rows] == [2, 2, 1]
    assert [r["rollouts"] for r in rows] == [3, 1, 1]  # every rollout graded in the window, once
    assert [r["reward/mean"] for r in rows] == pytest.approx([1 / 3, 0.5, 1.0])  # pooled over rollouts
    assert [r["pass_rate"] for r in rows] == pytest.approx([1 / 3, 1.0, 1.0])
    assert [r["length/mean"] for r in rows] == [2.0, 2.0, 4.0]
    assert [r["train/loss"] for r in rows] == [1.5, 3.5, 5.0]  # per-update values: the mean,
    assert [r["train/ratio_min"] for r in rows] == pytest.approx([0.8, 0.6, 0.5])  # the min of *_min,
    assert [r["train/ratio_max"] for r in rows] == pytest.approx([1.2, 1.4, 1.5])  # the max of *_max,
    assert [r["batch/sequences"] for r in rows] == [3, 7, 10]
    assert [r["push/version"] for r in rows] == [2, 4, 5]  # the last version,
    assert [r["push/bytes"] for r in rows] == [150, 350, 500]
    assert [r["version"] for r in rows] == [2, 4, 5]


def test_every_update_gets_its_own_line_by_default(tmp_path):
    ctrl = _controller(tmp_path, updates=3, log_every=1)
    for u in range(1, 4):
        _update(ctrl, u, [_rollout(float(u), 0.0)])
    rows = _rows(ctrl, tmp_path)
    assert [(r["update"], r["updates_in_line"], r["rollouts"], r["reward/mean"]) for r in rows] == \
           [(1, 1, 1, 1.0), (2, 1, 1, 2.0), (3, 1, 1, 3.0)]
    assert [(r["train/loss"], r["batch/sequences"], r["push/bytes"]) for r in rows] == \
           [(1.0, 2, 100), (2.0, 4, 200), (3.0, 6, 300)]


def test_a_stop_between_two_lines_writes_the_updates_since_the_last_one(tmp_path):
    ctrl = _controller(tmp_path, updates=10, log_every=4)
    for u in range(1, 7):
        _update(ctrl, u, [_rollout(1.0, 1.0)])
    ctrl._write_metrics()  # what Controller.run does once it stops, before its checkpoint
    ctrl._write_metrics()  # nothing pending: no second line
    rows = _rows(ctrl, tmp_path)
    assert [(r["update"], r["updates_in_line"], r["rollouts"]) for r in rows] == [(4, 4, 4), (6, 2, 2)]


def test_no_line_before_the_first_update():
    assert UpdateWindow().line(config_from_dict({}).run, 0, 0, {}, {}, {}) is None


def test_merge_updates_rules():
    assert merge_updates([{"a": 1, "v_min": 3}]) == {"a": 1, "v_min": 3}  # one update: as it is
    merged = merge_updates([{"a": 1.0, "x_min": 2, "x_max": 2, "version": 7, "s": "p"},
                            {"a": 3.0, "x_min": 1, "x_max": 5, "version": 8, "s": "q", "b": 4.0}])
    assert merged == {"a": 2.0, "x_min": 1, "x_max": 5, "version": 8, "s": "q", "b": 4.0}
