"""`megatron-rl experiment`: the shipped experiments load and merge into valid configs; the runner skips,
resumes and restarts runs as documented; the table's numbers equal window means computed by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_rl.experiments import report, runner
from megatron_rl.experiments.spec import ExperimentError, list_experiments, load_experiment
from megatron_rl.train.checkpoint_dirs import TRACKER

pytestmark = pytest.mark.unit


@pytest.fixture
def data_dir(tmp_path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "problems.jsonl").write_text("")
    (d / "eval.jsonl").write_text("")
    return d


def _models(exp, model: str) -> dict[str, str]:
    return {arm: model for arm in exp.arms}


def test_issue_19_experiments_exist_and_every_arm_is_a_valid_config(tmp_path, data_dir):
    assert {"batch_vs_minibatch", "adv_norm", "clip_higher", "async_vs_sync", "tool_use", "distill", "lora"} <= set(list_experiments())
    for name in list_experiments():
        exp = load_experiment(name)
        assert len(exp.arms) >= 2 and exp.seeds >= 2, name
        runs = runner.plan_runs(exp, tmp_path / name, exp.seeds, None)
        teacher = runner.teacher_for(exp, list(exp.arms), tmp_path / "prep", None)
        runner.write_configs(exp, runs, exp.updates, _models(exp, "smollm2-135m"), data_dir, [], teacher)  # load_config checks each
        assert len(runs) == len(exp.arms) * exp.seeds
    # the arm's override wins over the base; the runner's per-run keys over both
    exp = load_experiment("batch_vs_minibatch")
    run = runner.plan_runs(exp, tmp_path / "b", 2, ["n_mini4"])[1]
    runner.write_configs(exp, [run], 7, _models(exp, "MODEL"), data_dir, [])
    cfg = yaml.safe_load(run.config_path.read_text())
    assert cfg["rollout"]["n_mini"] == 4 and cfg["rollout"]["n_batch"] == exp.base["rollout"]["n_batch"]
    assert (cfg["run"]["updates"], cfg["run"]["output_dir"], cfg["trainer"]["model"]) == (7, str(run.run_dir), "MODEL")
    assert cfg["data"]["seed"] == 1 and cfg["trainer"]["seed"] == exp.base["trainer"]["seed"] + 1


def test_the_cold_start_command_is_a_valid_sft_config(tmp_path, data_dir):
    from megatron_rl.config import load_config

    args = runner.sft_arguments(runner.ROOT / "experiments" / "base.yaml", data_dir, tmp_path / "sft")
    config_file, overrides = args[0], [a for a in args[1:] if "=" in a]
    cfg = load_config(config_file, overrides)
    assert (cfg.trainer.lr, cfg.data.path) == (5e-5, str(data_dir / "problems.jsonl"))


def test_bad_arm_or_override_names_the_file(tmp_path, data_dir):
    exp = load_experiment("adv_norm")
    with pytest.raises(ExperimentError, match="no arm"):
        runner.plan_runs(exp, tmp_path, 1, ["nope"])
    exp.arms["group"] = {"algo": {"adv_norm": "sometimes"}}
    with pytest.raises(ExperimentError, match=r"arms/group.yaml.*adv_norm"):
        runner.write_configs(exp, runner.plan_runs(exp, tmp_path, 1, ["group"]), 2, _models(exp, "m"), data_dir, [])
    with pytest.raises(ExperimentError, match="no experiment"):
        load_experiment("no_such_experiment")


def _experiment_dir(tmp_path: Path, prepare) -> Path:
    d = tmp_path / "exp"
    (d / "arms").mkdir(parents=True)
    (tmp_path / "base.yaml").write_text("")
    for arm in ("a", "b", "c"):
        (d / "arms" / f"{arm}.yaml").write_text("")
    (d / "experiment.yaml").write_text(yaml.safe_dump({"claim": "x", "prepare": prepare}))
    return d


@pytest.mark.parametrize("prepare, error", [
    ("examples/tool_demo_data.py", "prepare must be"),
    ({"data": "examples/tool_demo_data.py"}, "prepare must be"),
    ({"data": "examples/nope.py", "sft": {"a": "t.jsonl", "b": "t.jsonl", "c": "t.jsonl"}}, "prepare.data: .*nope.py not found"),
    ({"data": "examples/tool_demo_data.py", "sft": {"a": "t.jsonl", "d": "t.jsonl"}},
     r"prepare.sft must name .* missing \['b', 'c'\], unknown \['d'\]"),
])
def test_a_bad_prepare_key_is_one_line_naming_it(tmp_path, prepare, error):
    with pytest.raises(ExperimentError, match=error) as e:
        load_experiment(str(_experiment_dir(tmp_path, prepare)))
    assert "experiment.yaml" in str(e.value) and "\n" not in str(e.value)


def test_prepare_makes_the_data_once_and_one_cold_start_per_traces_file(tmp_path, monkeypatch):
    """An experiment's own preparation: its data script, then an SFT + HF export per distinct traces file
    (arms naming the same file share the model), in PREP/NAME; made once, reused by the next call. The
    experiments without `prepare` share the demo's, in PREP itself."""
    calls = []

    def fake(cmd, what):  # what each step leaves behind
        calls.append(what)
        if what == "data":
            (Path(cmd[-1]) / "problems.jsonl").parent.mkdir(parents=True)
            (Path(cmd[-1]) / "problems.jsonl").write_text("")
        elif what.startswith("SFT"):
            out = Path(next(a for a in cmd if a.startswith("run.output_dir=")).split("=", 1)[1])
            (out / "checkpoints").mkdir(parents=True)
            (out / "checkpoints" / TRACKER).write_text("4")
        else:  # export to HF
            Path(cmd[-3]).mkdir(parents=True)
            (Path(cmd[-3]) / "config.json").write_text("{}")

    monkeypatch.setattr(runner, "_call", fake)
    exp = load_experiment(str(_experiment_dir(tmp_path, {
        "data": "examples/tool_demo_data.py", "sft": {"a": "tool.jsonl", "b": "direct.jsonl", "c": "tool.jsonl"}})))
    prep = tmp_path / "prep"
    models, data = runner.prepare(exp, ["a", "b", "c"], prep, tmp_path / "base.yaml", None, None)
    assert data == prep / "exp" / "data" and calls[0] == "data"
    assert models == {"a": str(prep / "exp" / "tool-hf"), "b": str(prep / "exp" / "direct-hf"),
                      "c": str(prep / "exp" / "tool-hf")}
    assert calls[1:] == ["SFT cold start on direct.jsonl", "export to HF", "SFT cold start on tool.jsonl", "export to HF"]
    assert runner.prepare(exp, ["b"], prep, tmp_path / "base.yaml", None, None) == ({"b": models["b"]}, data)
    assert len(calls) == 5  # nothing made twice
    assert runner.prepare(exp, ["a"], prep, tmp_path / "base.yaml", "M", None)[0] == {"a": "M"}  # --base-model

    demo = load_experiment("adv_norm")  # no `prepare`: the demo's, shared, where it has always been
    models, data = runner.prepare(demo, list(demo.arms), prep, tmp_path / "base.yaml", None, None)
    assert data == prep / "data" and set(models.values()) == {str(prep / "sft-hf")}
    assert calls[5:] == ["data", "SFT cold start on sft.jsonl", "export to HF"]


@pytest.mark.parametrize("teacher, error", [
    ({"updates": 20}, "teacher must be"),
    ({"updates": 0, "arms": ["a"]}, "teacher must be"),
    ({"updates": 5, "arms": []}, "teacher must be"),
    ({"updates": 5, "arms": ["a", "z"]}, r"teacher.arms: no arm \['z'\]"),
])
def test_a_bad_teacher_key_is_one_line_naming_it(tmp_path, teacher, error):
    d = _experiment_dir(tmp_path, None)
    (d / "experiment.yaml").write_text(yaml.safe_dump({"claim": "x", "teacher": teacher}))
    with pytest.raises(ExperimentError, match=error) as e:
        load_experiment(str(d))
    assert "experiment.yaml" in str(e.value) and "\n" not in str(e.value)


def test_the_teacher_is_the_base_configs_rl_run_made_once_and_set_for_its_arms_only(tmp_path, monkeypatch):
    """`teacher: {updates, arms}`: before the arms run, the base config is trained with RL for `updates`
    from the distilling arms' cold start (a normal resumable run), exported to HF once, and becomes the
    algo.teacher of those arms only; --teacher names an existing one instead; no distilling arm chosen:
    no teacher."""
    calls = []

    def fake(cmd, what):
        calls.append((what, cmd))
        if what.startswith("teacher"):  # `megatron-rl train`: metrics up to run.updates, a final checkpoint
            cfg = yaml.safe_load(Path(cmd[cmd.index("train") + 1]).read_text())
            run_dir = Path(cfg["run"]["output_dir"])
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (run_dir / "checkpoints" / TRACKER).write_text(str(cfg["run"]["updates"]))
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"update": u + 1}) + "\n"
                                                           for u in range(cfg["run"]["updates"])))
        else:  # export to HF
            Path(cmd[-3]).mkdir(parents=True)
            (Path(cmd[-3]) / "config.json").write_text("{}")

    monkeypatch.setattr(runner, "_call", fake)
    exp = load_experiment("distill")
    assert exp.teacher is not None and exp.teacher.arms == ("distill",)
    exp.arms["plain"] = {}  # an arm that does not distil
    data = tmp_path / "data"
    data.mkdir()
    (data / "problems.jsonl").write_text("")
    prep = tmp_path / "prep"
    assert runner.teacher_for(exp, ["plain"], prep, None) is None
    assert runner.teacher_for(exp, ["distill", "plain"], prep, "T") == "T"  # --teacher
    assert runner.teacher_for(exp, ["rl"], prep, "T") is None  # rl does not distil
    teacher = runner.teacher_for(exp, ["distill", "plain"], prep, None)
    assert teacher == str(prep / "distill" / "teacher-hf")
    runs = runner.plan_runs(exp, tmp_path / "out", 1, ["distill", "plain"])
    models = {"distill": "SFT", "plain": "SFT"}
    runner.write_configs(exp, runs, 3, models, data, [], teacher)
    configs = {r.arm: yaml.safe_load(r.config_path.read_text()) for r in runs}
    assert configs["distill"]["algo"]["teacher"] == teacher and configs["distill"]["algo"]["distill_only"]
    assert "teacher" not in configs["plain"].get("algo", {})

    runner.make_teacher(exp, Path(teacher), models, data, ["rollout.n_batch=8"])
    what, cmd = calls[0]
    cfg = yaml.safe_load((prep / "distill" / "teacher.yaml").read_text())
    assert what == "teacher-seed0 (start)" and cmd[-2:] == ["rollout.n_batch=8", "run.resume=auto"]
    assert (cfg["trainer"]["model"], cfg["run"]["updates"]) == ("SFT", exp.teacher.updates)
    assert cfg.get("algo") == exp.base.get("algo") and cfg["run"]["output_dir"] == str(prep / "distill" / "teacher")
    assert calls[1][0] == "export the teacher to HF" and calls[1][1][-4:-1] == [
        str(prep / "distill" / "teacher" / "checkpoints"), teacher, "--hf-config"]
    assert not (prep / "distill" / "teacher" / "checkpoints").exists()  # exported: 2 GB freed
    runner.make_teacher(exp, Path(teacher), models, data, [])
    assert len(calls) == 2  # made once


def test_runner_skips_finished_resumes_checkpointed_and_restarts_the_rest(tmp_path, monkeypatch):
    calls = []

    def fake_train(cmd, what):  # what `megatron-rl train` leaves: metrics lines up to run.updates
        calls.append(cmd)
        run_dir = Path(yaml.safe_load(Path(cmd[cmd.index("train") + 1]).read_text())["run"]["output_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints" / "step_1").mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"update": u}) + "\n" for u in (1, 2)))

    monkeypatch.setattr(runner, "_call", fake_train)
    exp = load_experiment("batch_vs_minibatch")
    data = tmp_path / "data"
    data.mkdir()
    (data / "problems.jsonl").write_text("")
    fresh, resumed, finished = runner.plan_runs(exp, tmp_path / "out", 3, ["n_mini1"])
    runner.write_configs(exp, [fresh, resumed, finished], 2, _models(exp, "m"), data, [])
    (fresh.run_dir / "stale.txt").parent.mkdir(parents=True)
    (fresh.run_dir / "stale.txt").write_text("left by a run stopped before its first checkpoint")
    (resumed.run_dir / "checkpoints").mkdir(parents=True)
    (resumed.run_dir / "checkpoints" / TRACKER).write_text("1")
    finished.run_dir.mkdir(parents=True)
    (finished.run_dir / runner.DONE_FILE).write_text(json.dumps({"updates": 2}))

    assert runner.run_one(fresh, 2, ["x.y=1"], keep_checkpoints=False) == "started"
    assert calls[-1][-2:] == ["x.y=1", "run.resume=auto"] and not (fresh.run_dir / "stale.txt").exists()
    assert not (fresh.run_dir / "checkpoints").exists() and runner.done_updates(fresh) == 2
    assert runner.run_one(resumed, 2, [], keep_checkpoints=True) == "resumed"
    assert calls[-1][-1] == "--resume" and (resumed.run_dir / "checkpoints").exists()
    n = len(calls)
    assert runner.run_one(finished, 2, [], keep_checkpoints=False) == "skipped" and len(calls) == n
    with pytest.raises(ExperimentError, match="checkpoints were deleted"):  # extending needs them
        runner.run_one(fresh, 5, [], keep_checkpoints=False)
    runner.collect([fresh, resumed, finished], tmp_path / "results")
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["n_mini1-seed0.jsonl", "n_mini1-seed1.jsonl"]


def _rows(rewards, rollouts, walls):
    return [{"update": u, "reward/mean": r, "rollouts": n, "train/entropy": 0.1 * u, "wall_s": w}
            for u, (r, n, w) in enumerate(zip(rewards, rollouts, walls), 1)]


def test_table_and_figure_from_results(tmp_path):
    exp = load_experiment("async_vs_sync")
    exp.metrics = ["reward/mean", "train/entropy"]
    res = tmp_path / "results"
    res.mkdir()
    seed0 = _rows([0.2, 0.4, 0.6, 0.8], [10, 30, 10, 30], [10, 10, 10, 10])  # wall_s: each line's duration
    seed1 = _rows([0.4, 0.4, 0.9, 0.9], [20, 20, 20, 20], [15, 15, 15, 15])
    for seed, rows in enumerate((seed0, seed1)):
        (res / f"async-seed{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seed0, seed1 = report.with_elapsed(seed0), report.with_elapsed(seed1)  # elapsed 10, 20, 30, 40 s / 15, ..., 60 s
    # window = 4 // 4 = 1 update: the line itself; at update 2 with a 2-update window, sample-weighted
    assert report.trailing_mean(seed0, "reward/mean", 2, 2) == pytest.approx((0.2 * 10 + 0.4 * 30) / 40)
    assert report.trailing_mean(seed0, "train/entropy", 4, 2) == pytest.approx((0.3 + 0.4) / 2)  # unweighted
    assert report.trailing_mean(seed0, "reward/mean", 25, 1, x="elapsed_s") == pytest.approx(0.4)  # update 2 at 20 s
    assert report.time_to_target(seed0, "reward/mean", 0.7, 1) == 40 and report.time_to_target(seed1, "reward/mean", 0.7, 1) == 45
    assert report.time_to_target(seed0, "reward/mean", 0.95, 1) is None
    table_path, fig = report.write_report(exp, res, 4)
    text = table_path.read_text()
    # @4: seed means 0.8 and 0.9 -> 0.85 [0.8, 0.9]; time to 0.7: 40 and 45 s -> 42.5 [40, 45]
    assert "| async | 2 | 0.3 [0.2, 0.4] | 0.4 [0.4, 0.4] | 0.75 [0.6, 0.9] | 0.85 [0.8, 0.9] |" in text
    assert "| async | 2 | 42.5 [40, 45] |" in text
    assert fig.is_file() and fig.stat().st_size > 0
