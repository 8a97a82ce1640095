"""Run every arm x seed of an experiment, one normal `megatron-rl train` after another, resumably.

Per run (OUT/ARM/seedK, its merged config OUT/ARM/seedK.yaml):
- finished (OUT/ARM/seedK/experiment_done.json for at least the updates asked): skipped;
- a checkpoint there: continued with `megatron-rl train CONFIG --resume` (a stopped experiment goes on
  where it stopped, and a finished run asked for more updates is extended);
- otherwise started afresh (a run stopped before its first checkpoint starts over in an emptied directory).
A finished run's metrics.jsonl is copied to the results directory and its checkpoints are deleted
(2 GB each for SmolLM2-135M with Adam; --keep-checkpoints keeps them).

The model and data are prepared once in PREP (default OUT/../_prepare, shared by the experiments):
the CPU demo's data (examples/cpu_demo_data.py) and its SFT cold start + HF export, unless
--base-model / --data name existing ones. An experiment with its own `prepare` (spec.Preparation) gets
them in PREP/NAME: its data script's output and one cold start per traces file its arms name. An
experiment with a `teacher` (spec.Teacher) also gets PREP/NAME/teacher-hf: the base config's RL run from
its distilling arms' cold start (PREP/NAME/teacher, resumable like the others), exported to HF, unless
--teacher names one.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from megatron_rl.experiments.spec import Experiment, ExperimentError, Preparation, RunSpec, run_config
from megatron_rl.train.checkpoint_dirs import holds_checkpoints

DONE_FILE = "experiment_done.json"
ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", *args]


def _call(cmd: list[str], what: str) -> None:
    print(f"[experiment] {what}: {' '.join(cmd)}", flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    status = subprocess.call(cmd, env=env)
    if status != 0:
        raise RuntimeError(f"{what} failed (exit status {status}); run the experiment command again to continue")


def sft_arguments(base_config: Path, data: Path, sft_dir: Path, traces: str = "sft.jsonl") -> list[str]:
    """`megatron-rl sft` arguments of the demo's cold start (examples/cpu_demo.sh). The base config's
    data paths are set per run, so they are given here too: the config must validate."""
    return [str(base_config), "trainer.lr=5e-5", f"run.output_dir={sft_dir}",
            f"data.path={data / 'problems.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}",
            "--data", str(data / traces), "--batch-size", "8", "--epochs", "1"]


def prepare(exp: Experiment, arms: list[str], prep_dir: Path, base_config: Path, base_model: str | None,
            data_dir: str | None) -> tuple[dict[str, str], Path]:
    """(model for RL of each of `arms`, data directory): the experiment's data and SFT cold starts, each
    made once (spec.Preparation)."""
    prep: Preparation = exp.preparation
    home = prep_dir if prep.shared else prep_dir / exp.name
    data = Path(data_dir) if data_dir else home / "data"
    if not (data / "problems.jsonl").is_file():
        if data_dir:
            raise ExperimentError(f"--data {data_dir}: no problems.jsonl there")
        _call([sys.executable, str(prep.script), str(data)], "data")
    if base_model:
        return {arm: base_model for arm in arms}, data
    models = {traces: cold_start(home, base_config, data, traces) for traces in sorted({prep.traces[a] for a in arms})}
    return {arm: models[prep.traces[arm]] for arm in arms}, data


def cold_start(home: Path, base_config: Path, data: Path, traces: str) -> str:
    """The HF export of an SFT cold start on DATA/TRACES (the demo's, examples/cpu_demo.sh), made once in
    HOME/STEM (checkpoints) and HOME/STEM-hf, STEM the traces' file name without its suffix."""
    stem = Path(traces).stem
    hf_dir = home / f"{stem}-hf"
    if not (hf_dir / "config.json").is_file():
        sft_dir = home / stem
        if not holds_checkpoints(sft_dir / "checkpoints"):
            _call(_cli("sft", *sft_arguments(base_config, data, sft_dir, traces)), f"SFT cold start on {traces}")
        _call(_cli("convert", "to-hf", str(sft_dir / "checkpoints"), str(hf_dir), "--hf-config", "smollm2-135m"),
              "export to HF")
    return str(hf_dir)


def teacher_for(exp: Experiment, arms: list[str], prep_dir: Path, teacher_model: str | None) -> str | None:
    """The HF directory that exp.teacher's arms among `arms` distil from (None: no such arm): `teacher_model`
    if given, else PREP/NAME/teacher-hf (made by `make_teacher`)."""
    if exp.teacher is None or not set(arms) & set(exp.teacher.arms):
        return None
    return teacher_model or str(prep_dir / exp.name / "teacher-hf")


def make_teacher(exp: Experiment, hf_dir: Path, models: dict[str, str], data: Path, overrides: list[str]) -> None:
    """Train the teacher once (spec.Teacher): the base config's RL run from the distilling arms' cold start
    in HF_DIR/../teacher, resumable like the arms' runs, then its HF export in HF_DIR."""
    assert exp.teacher is not None
    if (hf_dir / "config.json").is_file():
        return
    home = hf_dir.parent
    run = RunSpec("teacher", 0, home / "teacher", home / "teacher.yaml")
    model = next(models[a] for a in exp.teacher.arms if a in models)
    _write_config(run, run_config(exp, None, 0, run.run_dir, exp.teacher.updates, model, data), overrides,
                  f"the teacher's run ({exp.directory / 'experiment.yaml'} teacher)")
    run_one(run, exp.teacher.updates, overrides, keep_checkpoints=True)
    _call(_cli("convert", "to-hf", str(run.run_dir / "checkpoints"), str(hf_dir), "--hf-config", "smollm2-135m"),
          "export the teacher to HF")
    shutil.rmtree(run.run_dir / "checkpoints", ignore_errors=True)


def plan_runs(exp: Experiment, out: Path, seeds: int, arms: list[str] | None) -> list[RunSpec]:
    chosen = arms or list(exp.arms)
    unknown = [a for a in chosen if a not in exp.arms]
    if unknown:
        raise ExperimentError(f"{exp.name}: no arm {unknown} (arms: {', '.join(exp.arms)})")
    return [RunSpec(arm, seed, out / arm / f"seed{seed}", out / arm / f"seed{seed}.yaml")
            for arm in chosen for seed in range(seeds)]


def write_configs(exp: Experiment, runs: list[RunSpec], updates: int, models: dict[str, str], data: Path,
                  overrides: list[str], teacher: str | None = None) -> None:
    """Write every run's merged config and check it (with the overrides) before anything runs."""
    for run in runs:
        cfg = run_config(exp, run.arm, run.seed, run.run_dir, updates, models[run.arm], data, teacher)
        _write_config(run, cfg, overrides, f"arm {run.arm} ({exp.directory / 'arms' / (run.arm + '.yaml')})")


def _write_config(run: RunSpec, cfg: dict, overrides: list[str], what: str) -> None:
    from megatron_rl.config import ConfigError, load_config

    run.config_path.parent.mkdir(parents=True, exist_ok=True)
    run.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    try:
        load_config(run.config_path, overrides)
    except ConfigError as e:
        raise ExperimentError(f"{what}: {e}") from None


def done_updates(run: RunSpec) -> int:
    marker = run.run_dir / DONE_FILE
    return int(json.loads(marker.read_text())["updates"]) if marker.is_file() else 0


def _last_update(run_dir: Path) -> int:
    from megatron_rl.control.metrics import read_jsonl

    return max((int(r.get("update", 0)) for r in read_jsonl(run_dir / "metrics.jsonl")), default=0)


def run_one(run: RunSpec, updates: int, overrides: list[str], keep_checkpoints: bool) -> str:
    """Run (or continue) one arm x seed to `updates`; returns skipped / resumed / started."""
    done = done_updates(run)
    if done >= updates:
        return "skipped"
    resume = holds_checkpoints(run.run_dir / "checkpoints")
    if done and not resume:
        raise ExperimentError(f"{run.label}: finished at {done} updates and its checkpoints were deleted; "
                              f"to extend it, delete {run.run_dir} (or run with --keep-checkpoints from the start)")
    if not resume and run.run_dir.exists():  # stopped before its first checkpoint: nothing to keep
        shutil.rmtree(run.run_dir)
    extra = ["--resume"] if resume else ["run.resume=auto"]
    t0 = time.time()
    _call(_cli("train", str(run.config_path), *overrides, *extra), f"{run.label} ({'resume' if resume else 'start'})")
    reached = _last_update(run.run_dir)
    if reached < updates:
        raise RuntimeError(f"{run.label}: the run ended at update {reached} of {updates} (stopped?); "
                           f"run the experiment command again to continue it")
    (run.run_dir / DONE_FILE).write_text(json.dumps({"updates": reached, "session_wall_s": time.time() - t0}))
    if not keep_checkpoints:
        shutil.rmtree(run.run_dir / "checkpoints", ignore_errors=True)
    return "resumed" if resume else "started"


def collect(runs: list[RunSpec], results_dir: Path) -> None:
    """Copy each finished run's metrics.jsonl to RESULTS/ARM-seedK.jsonl (what the report reads)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    for run in runs:
        src = run.run_dir / "metrics.jsonl"
        if done_updates(run) and src.is_file():
            shutil.copyfile(src, results_dir / f"{run.label}.jsonl")
