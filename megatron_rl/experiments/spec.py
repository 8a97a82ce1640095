"""An experiment: a shared base config, one YAML of overrides per arm, and what to compare.

    experiments/base.yaml                the base training config shared by every experiment
    experiments/NAME/experiment.yaml     claim, base, updates, seeds, metrics, x axis, optional target,
                                         optional prepare (its own data and SFT cold starts)
    experiments/NAME/arms/ARM.yaml       the overrides of one arm (nested like a config file)
    experiments/NAME/results/            metrics of every run (ARM-seedK.jsonl), table.md, figure.png

An arm's run config = base, then the arm's overrides, then what the runner sets per run (output dir,
updates, seed, model and data paths), then the command line's --set overrides. The model and data are
made once before the runs (`Preparation`): by default the CPU demo's, shared by every experiment that
does not say `prepare: {data: SCRIPT, sft: {ARM: TRACES, ...}}` (a script `python SCRIPT DIR` that
writes problems.jsonl, eval.jsonl and the traces; each arm's cold start trains on the traces it names). An
experiment whose arms distil from a teacher says `teacher: {updates: N, arms: [ARM, ...]}`: the runner
first trains the base config with RL for N updates from those arms' cold start, exports it to HF and sets
it as their `algo.teacher` (`Teacher`). Every arm is checked with the project's own config loader before
anything runs, so a bad key names the arm's file.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS_DIR = ROOT / "experiments"
SPEC_FILE = "experiment.yaml"
_KEYS = {"claim", "base", "updates", "seeds", "metrics", "x", "target", "at_updates", "prepare", "teacher"}
DEMO_DATA = ROOT / "examples" / "cpu_demo_data.py"  # the default preparation's data: the CPU demo's


class ExperimentError(ValueError):
    """A bad experiment definition; the message names the file and key."""


@dataclass
class Target:
    """Time to reach: the first wall time at which `metric`'s trailing mean over `window` updates >= value."""

    metric: str
    value: float


@dataclass(frozen=True)
class Preparation:
    """Made once before the runs: the data (`python script DIR`) and one SFT cold start per traces file
    (a file the script writes) that the arms name. `shared`: the CPU demo's, made in the preparation
    directory itself and shared by every experiment without a `prepare` key; else in its NAME/ below it."""

    script: Path
    traces: dict[str, str]  # arm -> the SFT traces (in the data directory) its cold start trains on
    shared: bool = False


@dataclass(frozen=True)
class Teacher:
    """The model that `arms` distil from (their algo.teacher): the base config trained with RL for `updates`
    updates from those arms' cold start, made once in PREP/NAME/teacher and exported to HF (or an HF
    directory given with --teacher)."""

    updates: int
    arms: tuple[str, ...]


@dataclass
class Experiment:
    name: str
    directory: Path
    claim: str
    base: dict[str, Any]
    arms: dict[str, dict[str, Any]]  # arm name -> overrides, in file-name order
    preparation: Preparation  # the data and cold starts the runs start from
    updates: int = 20
    seeds: int = 2
    metrics: list[str] = field(default_factory=lambda: ["reward/mean", "pass_rate"])
    x: Literal["update", "elapsed_s"] = "update"  # elapsed_s: wall time (report.with_elapsed)
    target: Target | None = None
    at_updates: list[int] | None = None  # table columns (default: quarters of the run)
    teacher: Teacher | None = None  # the arms that distil, and from what

    @property
    def results_dir(self) -> Path:
        return self.directory / "results"

    def table_updates(self, updates: int) -> list[int]:
        if self.at_updates:
            return [u for u in self.at_updates if u <= updates] or [updates]
        return sorted({max(1, round(updates * q / 4)) for q in (1, 2, 3, 4)})


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ExperimentError(f"{path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise ExperimentError(f"{path}: must hold a mapping, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in, section by section (a copy; neither input changes)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def experiment_dir(name: str) -> Path:
    """NAME under experiments/, or a directory path holding an experiment.yaml."""
    direct = Path(name)
    if (direct / SPEC_FILE).is_file():
        return direct
    found = EXPERIMENTS_DIR / name
    if not (found / SPEC_FILE).is_file():
        known = ", ".join(list_experiments()) or "none"
        raise ExperimentError(f"no experiment {name!r}: {found / SPEC_FILE} not found (known: {known})")
    return found


def list_experiments() -> list[str]:
    return sorted(p.parent.name for p in EXPERIMENTS_DIR.glob(f"*/{SPEC_FILE}"))


def load_experiment(name: str) -> Experiment:
    directory = experiment_dir(name)
    spec_path = directory / SPEC_FILE
    spec = _read_yaml(spec_path)
    unknown = set(spec) - _KEYS
    if unknown:
        raise ExperimentError(f"{spec_path}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    base_path = (directory / spec.get("base", "../base.yaml")).resolve()
    arms = {p.stem: _read_yaml(p) for p in sorted((directory / "arms").glob("*.yaml"))}
    if not arms:
        raise ExperimentError(f"{directory / 'arms'}: no arm YAML files")
    target = spec.get("target")
    if target is not None and not (isinstance(target, dict) and set(target) == {"metric", "value"}):
        raise ExperimentError(f"{spec_path}: target must be {{metric: NAME, value: NUMBER}}")
    exp = Experiment(
        name=directory.name, directory=directory, claim=str(spec.get("claim", "")).strip(),
        base=_read_yaml(base_path), arms=arms, preparation=_preparation(spec.get("prepare"), spec_path, list(arms)),
        updates=int(spec.get("updates", 20)),
        seeds=int(spec.get("seeds", 2)), metrics=list(spec.get("metrics", ["reward/mean", "pass_rate"])),
        x=spec.get("x", "update"), target=Target(str(target["metric"]), float(target["value"])) if target else None,
        at_updates=spec.get("at_updates"), teacher=_teacher(spec.get("teacher"), spec_path, list(arms)))
    if exp.x not in ("update", "elapsed_s"):
        raise ExperimentError(f"{spec_path}: x must be update or elapsed_s, got {exp.x!r}")
    if exp.updates < 1 or exp.seeds < 1:
        raise ExperimentError(f"{spec_path}: updates and seeds must be >= 1")
    return exp


def _preparation(prepare: Any, spec_path: Path, arms: list[str]) -> Preparation:
    if prepare is None:
        return Preparation(DEMO_DATA, {arm: "sft.jsonl" for arm in arms}, shared=True)
    if not (isinstance(prepare, dict) and set(prepare) == {"data", "sft"} and isinstance(prepare["sft"], dict)):
        raise ExperimentError(f"{spec_path}: prepare must be {{data: SCRIPT, sft: {{ARM: TRACES, ...}}}}, got {prepare!r}")
    script = ROOT / str(prepare["data"])
    if not script.is_file():
        raise ExperimentError(f"{spec_path}: prepare.data: {script} not found (a path from the repository root)")
    traces = {str(arm): str(name) for arm, name in prepare["sft"].items()}
    if set(traces) != set(arms):
        raise ExperimentError(f"{spec_path}: prepare.sft must name the traces of every arm and only those: "
                              f"missing {sorted(set(arms) - set(traces))}, unknown {sorted(set(traces) - set(arms))}")
    return Preparation(script, traces)


def _teacher(teacher: Any, spec_path: Path, arms: list[str]) -> Teacher | None:
    if teacher is None:
        return None
    form = "teacher must be {updates: N >= 1, arms: [ARM, ...]}"
    if not (isinstance(teacher, dict) and set(teacher) == {"updates", "arms"} and isinstance(teacher["arms"], list)
            and isinstance(teacher["updates"], int) and teacher["updates"] >= 1 and teacher["arms"]):
        raise ExperimentError(f"{spec_path}: {form}, got {teacher!r}")
    unknown = [a for a in teacher["arms"] if a not in arms]
    if unknown:
        raise ExperimentError(f"{spec_path}: teacher.arms: no arm {unknown} (arms: {', '.join(arms)})")
    return Teacher(teacher["updates"], tuple(str(a) for a in teacher["arms"]))


@dataclass(frozen=True)
class RunSpec:
    """One arm x seed: a normal training run in its own directory."""

    arm: str
    seed: int
    run_dir: Path
    config_path: Path  # the merged config, written next to the run directory

    @property
    def label(self) -> str:
        return f"{self.arm}-seed{self.seed}"


def run_config(exp: Experiment, arm: str | None, seed: int, run_dir: Path, updates: int, model: str,
               data_dir: Path, teacher: str | None = None) -> dict[str, Any]:
    """The merged config dict of one run (before the command line's --set overrides); arm None: the base
    alone (the teacher's run). `teacher`: the HF directory the arms of exp.teacher distil from."""
    per_run: dict[str, Any] = {
        "trainer": {"model": str(model), "seed": int(exp.base.get("trainer", {}).get("seed", 1234)) + seed},
        "data": {"source": "jsonl", "path": str(data_dir / "problems.jsonl"), "seed": seed},
        "run": {"output_dir": str(run_dir), "updates": updates},
    }
    if (data_dir / "eval.jsonl").is_file():
        per_run["data"]["eval_path"] = str(data_dir / "eval.jsonl")
    else:  # no held-out set given: no evaluation rounds
        per_run["run"]["eval_every"] = 0
    if teacher is not None and exp.teacher is not None and arm in exp.teacher.arms:
        per_run["algo"] = {"teacher": teacher}
    return deep_merge(deep_merge(exp.base, exp.arms[arm] if arm else {}), per_run)
