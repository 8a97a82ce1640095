"""run.loggers: metrics lines reach TensorBoard, W&B (offline) and MLflow under the names of metrics.jsonl,
read back with each tool's own reader; a resumed run continues in the same place without doubled steps."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from megatron_rl.config import RunConfig, config_from_dict
from megatron_rl.config.tree import ConfigError
from megatron_rl.control.metrics import METRICS_FILE
from megatron_rl.control.run_log import RunLog
from support.metric_logs import assert_same, jsonl_numbers, tensorboard_scalars


def _row(update: int, scale: float = 1.0) -> dict:
    """A metrics line as the controller writes one: numbers, a null (no idle time measured) and a string."""
    return {"update": update, "version": update, "time": 1.8e9 + update, "rollouts": 4.0 + update,
            "reward/mean": scale * update / 10, "pass_rate": 0.25 * scale, "train/grad_norm": 1.5 * update,
            "eval/pass@4": 0.5 + update / 100, "generator_idle_frac": None, "note": "text"}


def _write(run_dir: Path, loggers: list[str], rows: list[dict], cut_after: int | None = None) -> None:
    """Log `rows` through the run log; with `cut_after`, first cut metrics.jsonl back to the line of that
    update, as a resume from a checkpoint taken there does."""
    log = RunLog(RunConfig(output_dir=str(run_dir), loggers=loggers), run_dir)
    if cut_after is not None:
        size = sum(len(line) + 1 for line in (run_dir / METRICS_FILE).read_text().splitlines()[:cut_after])
        log.cut_back({"metrics": size, "groups": 0})
    for row in rows:
        log.write_row(row)
    log.close()


@pytest.mark.parametrize("loggers, where", [(["tensorboard"], "run.loggers"), (["jsonl", "comet"], "run.loggers[1]"),
                                            (["jsonl", "wandb", "wandb"], "run.loggers")])
def test_loggers_without_jsonl_unknown_or_twice_are_refused_naming_the_key(loggers, where):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"run": {"loggers": loggers}})
    assert str(e.value).startswith(f"{where}:") and "\n" not in str(e.value)


def test_a_missing_package_is_one_line_naming_run_loggers_and_the_package(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RuntimeError) as e:
        RunLog(RunConfig(loggers=["jsonl", "tensorboard", "wandb"]), tmp_path)
    assert str(e.value).startswith("run.loggers: wandb needs the package 'wandb'") and "\n" not in str(e.value)


def test_tensorboard_events_read_back_hold_the_metrics_lines_and_a_resume_replaces_redone_steps(tmp_path):
    _write(tmp_path, ["jsonl", "tensorboard"], [_row(u) for u in (1, 2, 3)])
    assert_same(tensorboard_scalars(tmp_path), jsonl_numbers(tmp_path))
    # killed after update 3, checkpoint at 2: the resumed process writes 3 again (other values) and 4
    _write(tmp_path, ["jsonl", "tensorboard"], [_row(3, scale=2.0), _row(4, scale=2.0)], cut_after=2)
    reference = jsonl_numbers(tmp_path)
    assert reference["reward/mean"] == {1: 0.1, 2: 0.2, 3: 0.6, 4: 0.8}
    assert_same(tensorboard_scalars(tmp_path), reference)


def _wandb(run_dir: Path) -> dict[str, dict[int, float]]:
    from support.wandb_log import history

    out: dict[str, dict[int, float]] = {}
    for log_file in sorted(run_dir.glob("wandb/wandb/offline-run-*/run-*.wandb")):
        for step, items in history(log_file):
            for key, value in items.items():
                if not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                    out.setdefault(key, {})[step] = value
    return out


def test_wandb_offline_run_holds_the_metrics_lines_and_a_resume_continues_its_id(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    monkeypatch.setenv("WANDB_API_KEY", "")  # nothing to log in with: offline or fail
    _write(tmp_path, ["jsonl", "wandb"], [_row(u) for u in (1, 2)])
    run_id = (tmp_path / "wandb" / "run_id").read_text().strip()
    started = int(time.time())
    while int(time.time()) == started:  # W&B names a run's directory by the second it started
        time.sleep(0.05)
    _write(tmp_path, ["jsonl", "wandb"], [_row(3)], cut_after=2)
    runs = sorted(p.name for p in (tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs)  # one W&B run, resumed
    assert_same(_wandb(tmp_path), jsonl_numbers(tmp_path))


def test_mlflow_run_read_back_by_its_client_holds_the_metrics_lines_and_a_resume_continues_it(tmp_path,
                                                                                             monkeypatch):
    from mlflow.tracking import MlflowClient

    from megatron_rl.control.loggers import mlflow_name

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "config.yaml").write_text("run:\n  updates: 3\n")
    _write(tmp_path, ["jsonl", "mlflow"], [_row(u) for u in (1, 2)])
    _write(tmp_path, ["jsonl", "mlflow"], [_row(3)], cut_after=2)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    reference = jsonl_numbers(tmp_path)
    assert mlflow_name("eval/pass@4") == "eval/pass_at_4" and set(run.data.metrics) == set(map(mlflow_name, reference))
    for key, by_step in reference.items():
        got = {m.step: m.value for m in client.get_metric_history(run_id, mlflow_name(key))}
        assert got == by_step, key
    assert [a.path for a in client.list_artifacts(run_id)] == ["config.yaml"]


def test_the_controllers_metrics_lines_reach_tensorboard(tmp_path):
    """The training loop's path: the controller's run log sends each line it writes to run.loggers."""
    from megatron_rl.control.controller import Controller
    from megatron_rl.plan.layout import RankLayout
    from megatron_rl.records import Problem, Rollout

    cfg = config_from_dict({"run": {"output_dir": str(tmp_path), "updates": 3, "loggers": ["jsonl", "tensorboard"]},
                            "data": {"source": "jsonl", "path": "unused.jsonl"}})
    ctrl = Controller(None, cfg, RankLayout(1, 1, 1), tmp_path, [Problem("p", "q", {"kind": "math"})], None)
    for u in (1, 2, 3):
        ctrl.log.window.graded += [Rollout("g#1", 0, [1], [5] * u, [-1.0] * u, [0] * u, "stop", reward=u / 3,
                                           reward_components={"format_ok": 1.0, "correct": u % 2})]
        ctrl.updates_done = ctrl.version = u
        ctrl.log.train = {"version": u, "loss": 1.0 / u, "entropy": 2.0 - u / 10, "grad_norm": float(u)}
        ctrl._write_metrics()
    ctrl.log.close()
    scalars = tensorboard_scalars(tmp_path)
    assert sorted(scalars["train/entropy"]) == [1, 2, 3] and "pass_rate" in scalars
    assert_same(scalars, jsonl_numbers(tmp_path))
