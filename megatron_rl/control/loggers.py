"""Where the metrics lines go besides RUN_DIR/metrics.jsonl: `run.loggers`.

metrics.jsonl (`jsonl`) is always on: it is the run's record (a resume cuts it back, `megatron-rl plot`
reads it). TensorBoard, W&B and MLflow receive the numbers of the same lines under the same names, with
the line's `update` as the step; only the controller (rank 0) writes metrics, so only it logs. Their
packages are imported when the first line is logged (`megatron-rl[loggers]` installs them), so a run
without them pays nothing; a missing one is reported when the run starts (`check_installed`).

Each backend writes under RUN_DIR and continues there on resume:
  tensorboard  RUN_DIR/tensorboard/ event files; a resumed process purges the steps it writes again
  wandb        RUN_DIR/wandb/, offline unless WANDB_MODE says otherwise (`wandb sync` uploads it later);
               the run id is kept in RUN_DIR/wandb/run_id so a resume continues the same W&B run
  mlflow       RUN_DIR/mlruns (a file store) unless MLFLOW_TRACKING_URI is set; run id in RUN_DIR/mlflow_run_id
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import secrets
from pathlib import Path
from typing import Any, Protocol

import yaml

from megatron_rl.config import RunConfig
from megatron_rl.control.metrics import METRICS_FILE, JsonlWriter
from megatron_rl.control.protocol import Cause, RunFailed

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
# Not sent as scalars: the step itself, and the wall-clock stamp every backend records on its own.
NOT_SCALARS = ("update", "time")


class MetricLogger(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line that the other backends receive (a null or a string is skipped)."""
    return {k: float(v) for k, v in row.items() if k not in NOT_SCALARS and isinstance(v, (int, float))
            and math.isfinite(v)}


def check_installed(names: list[str]) -> None:
    """Fail at the start of a run, not at its first metrics line, when a logger's package is missing
    (RunFailed: the controller reports it in one line and stops the workers)."""
    for name in names:
        package = PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise RunFailed(f"run.loggers: {name} needs the package '{package}', which is not installed "
                               f"(pip install 'megatron-rl[loggers]', or remove {name} from run.loggers)", Cause.INPUT)


def run_name(run: RunConfig, run_dir: Path) -> str:
    return run.logger_run_name or run_dir.resolve().name


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config (RUN_DIR/config.yaml, written at start) for the backends that keep one."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    return yaml.safe_load(path.read_text()) or {}


class JsonlLogger:
    """RUN_DIR/metrics.jsonl: the whole line (strings and nulls too), flushed as written."""

    def __init__(self, run_dir: Path):
        self.writer = JsonlWriter(run_dir / METRICS_FILE)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.writer.write(metrics)  # the line carries its own `update`

    def close(self) -> None:
        self.writer.close()


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        self.log_dir = run_dir / "tensorboard"
        self._writer = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # The first step this process writes: events at or after it from a killed process (updates
            # after its last checkpoint, done again now) are hidden, as metrics.jsonl is cut back.
            self._writer = SummaryWriter(str(self.log_dir), purge_step=step)
        for key, value in scalars(metrics).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()  # a killed run keeps what it logged

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbLogger:
    def __init__(self, run: RunConfig, run_dir: Path):
        self.run, self.run_dir, self.dir = run, run_dir, run_dir / "wandb"
        self._run = None

    def _start(self):
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        id_file = self.dir / "run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        return wandb.init(project=self.run.logger_project, name=run_name(self.run, self.run_dir),
                          tags=list(self.run.logger_tags) or None, config=run_config(self.run_dir),
                          dir=str(self.dir), id=run_id, resume="allow",
                          mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
                          settings=wandb.Settings(silent=True, console="off", disable_git=True))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._run is None:
            self._run = self._start()
        self._run.log(scalars(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


def mlflow_name(key: str) -> str:
    """MLflow takes letters, digits and `_-. :/` in a name: `eval/pass@4` becomes `eval/pass_at_4`."""
    return re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_"))


class MlflowLogger:
    def __init__(self, run: RunConfig, run_dir: Path):
        self.run, self.run_dir = run, run_dir
        self._client = None
        self._run_id = ""

    def _start(self) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow-skinny has no database backend
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (self.run_dir / "mlruns").resolve().as_uri()
        self._client = client = MlflowClient(tracking_uri=uri)
        id_file = self.run_dir / "mlflow_run_id"
        if id_file.is_file():
            self._run_id = id_file.read_text().strip()
            client.update_run(self._run_id, status="RUNNING")
            return
        experiment = client.get_experiment_by_name(self.run.logger_project)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.run.logger_project)
        tags = {tag: "" for tag in self.run.logger_tags}
        self._run_id = client.create_run(experiment_id, run_name=run_name(self.run, self.run_dir),
                                         tags=tags).info.run_id
        id_file.write_text(self._run_id + "\n")
        if (self.run_dir / "config.yaml").is_file():
            client.log_artifact(self._run_id, str(self.run_dir / "config.yaml"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        if self._client is None:
            self._start()
        stamp = int(1000 * float(metrics.get("time", 0.0)))
        batch = [Metric(mlflow_name(k), v, stamp, step) for k, v in scalars(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per call
            self._client.log_batch(self._run_id, metrics=batch[i:i + 1000])  # type: ignore[union-attr]

    def close(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self._run_id)


def open_loggers(run: RunConfig, run_dir: Path) -> tuple[JsonlLogger, list[MetricLogger]]:
    """metrics.jsonl and the other backends of run.loggers (opened at their first line)."""
    check_installed(run.loggers)
    others: list[MetricLogger] = []
    for name in run.loggers:
        if name == "tensorboard":
            others.append(TensorBoardLogger(run_dir))
        elif name == "wandb":
            others.append(WandbLogger(run, run_dir))
        elif name == "mlflow":
            others.append(MlflowLogger(run, run_dir))
    return JsonlLogger(run_dir), others
