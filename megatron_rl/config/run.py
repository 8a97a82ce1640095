"""The `run` section: where results go, how long the run lasts, evaluation and loggers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.tree import check


@dataclass
class RunConfig:
    """Where results go and how long the run lasts."""

    output_dir: str = "runs/default"
    updates: int = 100  # trainer updates (each = n_mini optimizer steps)
    checkpoint_every: int = 10
    # Checkpoints kept in output_dir/checkpoints: after each save all but the newest this many are
    # deleted (0 or null: keep all).
    keep_checkpoints: int | None = 3
    # One metrics line per log_every updates, plus one for the final update (and the last before a stop);
    # each line summarises the updates since the previous line.
    log_every: int = 1
    # A checkpoint in output_dir: fresh = refuse to touch it (start a new run in another output_dir),
    # require = continue from it, error without one (`megatron-rl train --resume`), auto = continue from
    # it when there is one, else start afresh (a job that may be requeued).
    resume: Literal["fresh", "auto", "require"] = "fresh"
    # Evaluation on data.eval_path after every eval_every updates (0 = none), on the generators between
    # updates; its eval/... results go on the metrics line of the evaluated update (docs/control.md).
    eval_every: int = 0
    # With eval_every > 0: a round on the initial weights before the first update too (its line is
    # update 0), the baseline of every later round; a resumed run never evaluates update 0 again.
    eval_at_start: bool = True
    eval_samples: int = 4  # samples per evaluation problem: pass@1 is their mean, pass@k has k = eval_samples
    eval_temperature: float | None = None  # sampling temperature of the evaluation (null: rollout.temperature)
    eval_max_problems: int | None = None  # evaluate the first this many problems of data.eval_path (null: all)
    # On a machine without a GPU: split = each trainer rank and each generator's SGLang server computes on
    # its own share of its host's cores, one thread per core (control/node.py `assign_cpus`); shared =
    # every process may use every core with torch's default thread count (processes that compute at the
    # same time then stall each other's OpenMP threads). Ignored where there is a GPU.
    cpu_placement: Literal["split", "shared"] = "split"
    # Where metrics lines go: jsonl (RUN_DIR/metrics.jsonl, always on: the run's record), tensorboard
    # (RUN_DIR/tensorboard), wandb (RUN_DIR/wandb, offline unless WANDB_MODE is set), mlflow (RUN_DIR/mlruns
    # unless MLFLOW_TRACKING_URI is set); same metric names in all (docs/tools.md "Loggers and curves").
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["jsonl"])
    logger_project: str = "megatron-rl"  # W&B project and MLflow experiment
    logger_run_name: str | None = None  # W&B and MLflow run name (null: the name of output_dir)
    logger_tags: list[str] = field(default_factory=list)  # W&B tags and MLflow tags

    def validate(self, key: str) -> None:
        check(self.updates >= 1, f"{key}.updates", "must be >= 1")
        check("jsonl" in self.loggers, f"{key}.loggers",
              "must include jsonl (metrics.jsonl is the run's record: resume and `megatron-rl plot` read it)")
        check(len(set(self.loggers)) == len(self.loggers), f"{key}.loggers", f"names a logger twice: {self.loggers}")
        check(self.checkpoint_every >= 0, f"{key}.checkpoint_every", "must be >= 0 (0 = only at the end)")
        check(self.keep_checkpoints is None or self.keep_checkpoints >= 0, f"{key}.keep_checkpoints",
              "must be >= 0 (0 or null = keep all)")
        check(self.log_every >= 1, f"{key}.log_every", "must be >= 1")
        check(self.eval_every >= 0, f"{key}.eval_every", "must be >= 0 (0 = no evaluation)")
        check(self.eval_every % self.log_every == 0, f"{key}.eval_every",
              f"must be a multiple of run.log_every ({self.log_every}): results go on the evaluated update's line")
        check(self.eval_samples >= 1, f"{key}.eval_samples", "must be >= 1")
        check(self.eval_temperature is None or self.eval_temperature >= 0, f"{key}.eval_temperature",
              "must be >= 0 (0 = greedy) or null")
        check(self.eval_max_problems is None or self.eval_max_problems >= 1, f"{key}.eval_max_problems",
              "must be >= 1 or null (all)")
