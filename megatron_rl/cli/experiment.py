"""`megatron-rl experiment NAME [key=value ...] [--seeds N] [--updates N] [--out DIR]`: every arm x seed,
then a table and a figure (docs/experiments.md).

Runs are sequential, each a normal `megatron-rl train` in OUT/ARM/seedK; stopping (Ctrl-C) and running
the same command again skips finished runs and resumes the interrupted one from its checkpoint.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="experiment under experiments/ (or a directory with experiment.yaml)")
    parser.add_argument("--list", action="store_true", help="list the experiments and their arms")
    parser.add_argument("--seeds", type=int, help="seeds per arm (default: the experiment's, 2)")
    parser.add_argument("--updates", type=int, help="updates per run (default: the experiment's)")
    parser.add_argument("--out", help="run directories (default runs/experiments/NAME)")
    parser.add_argument("--results", help="metrics copies, table.md, figure.png (default experiments/NAME/results)")
    parser.add_argument("--arms", help="comma-separated subset of the arms (default: all)")
    parser.add_argument("--base-model", help="HF directory (or smollm2-135m) to start every arm's RL from instead "
                        "of the SFT cold starts made in PREP (the default), e.g. runs/cpu_demo/sft-hf")
    parser.add_argument("--data", help="directory with problems.jsonl (and eval.jsonl) (default: made in PREP by "
                        "the experiment's prepare.data script, else the demo's)")
    parser.add_argument("--teacher", help="HF directory the experiment's distilling arms (its `teacher` key) distil "
                        "from, e.g. runs/cpu_demo/rl-hf (default: the RL run made once in PREP/NAME/teacher-hf)")
    parser.add_argument("--prepare-dir", help="where data and the SFT model are made once (default OUT/../_prepare)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides applied to every run, e.g. "
                        "rollout.n_batch=8")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep finished runs' checkpoints (needed to extend them with more --updates later)")
    parser.add_argument("--report-only", action="store_true", help="only redraw the table and figure from RESULTS")


def _list() -> int:
    from megatron_rl.experiments.spec import list_experiments, load_experiment

    for name in list_experiments():
        exp = load_experiment(name)
        print(f"{name}: {', '.join(exp.arms)} ({exp.updates} updates x {exp.seeds} seeds)")
    return 0


def main(args: argparse.Namespace) -> int:
    from megatron_rl.experiments import report, runner
    from megatron_rl.experiments.spec import ExperimentError, load_experiment

    if args.list or not args.name:
        return _list()
    try:
        exp = load_experiment(args.name)
        updates = args.updates or exp.updates
        results_dir = Path(args.results) if args.results else exp.results_dir
        if not args.report_only:
            _run_all(exp, args, updates, results_dir, runner)
        table_path, fig_path = report.write_report(exp, results_dir, updates)
    except (ExperimentError, FileNotFoundError, RuntimeError) as e:
        print(f"megatron-rl experiment: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("megatron-rl experiment: stopped; run the same command again to continue", file=sys.stderr)
        return 130
    print(f"[experiment] {exp.name}: {table_path} and {fig_path}")
    print(table_path.read_text())
    return 0


def _run_all(exp, args: argparse.Namespace, updates: int, results_dir: Path, runner) -> None:
    out = Path(args.out) if args.out else Path("runs/experiments") / exp.name
    prep = Path(args.prepare_dir) if args.prepare_dir else out.parent / "_prepare"
    arms = [a.strip() for a in args.arms.split(",")] if args.arms else None
    runs = runner.plan_runs(exp, out, args.seeds or exp.seeds, arms)
    models, data = runner.prepare(exp, sorted({r.arm for r in runs}), prep, exp.directory.parent / "base.yaml",
                                  args.base_model, args.data)
    teacher = runner.teacher_for(exp, sorted(models), prep, args.teacher)
    runner.write_configs(exp, runs, updates, models, data, args.overrides, teacher)  # every run checked first
    if teacher and not args.teacher:
        runner.make_teacher(exp, Path(teacher), models, data, args.overrides)
    for i, run in enumerate(runs, 1):
        t0 = time.time()
        status = runner.run_one(run, updates, args.overrides, args.keep_checkpoints)
        print(f"[experiment] {exp.name} {i}/{len(runs)} {run.label}: {status} ({time.time() - t0:.0f} s)", flush=True)
        runner.collect([run], results_dir)
    # every run on its own (one colour per arm x seed, the curves of `megatron-rl plot`), beside the
    # report's figure of seed means
    from megatron_rl.experiments.plot import plot_runs

    plot_runs([r.run_dir for r in runs], results_dir / "runs.png", labels=[r.label for r in runs], metrics=exp.metrics)
