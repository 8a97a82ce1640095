"""What a training job leaves in its run directory so that a failure can be told in one line.

- `RUN_DIR/ranks/<rank>.pid`: `PID ROLE HOST` of each rank of the current start (mpiexec's and srun's
  messages name a dead rank's pid; these files map it to a rank and role).
- `RUN_DIR/failure.json`: written by rank 0 when the run fails: the failing rank, its role, the
  one-line error and its cause (protocol.Cause), which says whether starting again can help.
- `RUN_DIR/failure_traceback.txt`: a crash's traceback, named by that line.

`megatron-rl train` clears them before it starts a job and reads them when the job ends badly.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from megatron_rl.control.protocol import WorkerFailure

RANKS_DIR = "ranks"
REPORT = "failure.json"
TRACEBACK = "failure_traceback.txt"


def clear_records(run_dir: Path) -> None:
    """Remove an earlier start's pid files and failure report, so that none is taken for this start's."""
    shutil.rmtree(run_dir / RANKS_DIR, ignore_errors=True)
    for name in (REPORT, TRACEBACK):
        (run_dir / name).unlink(missing_ok=True)


def write_pid_file(run_dir: Path, rank: int, role: str, host: str) -> None:
    folder = run_dir / RANKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{rank}.pid").write_text(f"{os.getpid()} {role} {host}\n")


def rank_pids(run_dir: Path) -> str:
    """`PID ROLE rRANK` of every rank that wrote its pid file, comma-separated ("" when none did)."""
    rows = []
    for file in sorted((run_dir / RANKS_DIR).glob("*.pid"), key=lambda f: int(f.stem)):
        pid, role, _host = file.read_text().split()
        rows.append(f"{pid} {role} r{file.stem}")
    return ", ".join(rows)


def write_report(run_dir: Path, failure: WorkerFailure) -> str:
    """Record `failure` (rank 0); returns its line, which names the traceback file of a crash."""
    run_dir.mkdir(parents=True, exist_ok=True)
    line = failure.describe()
    if failure.trace:
        (run_dir / TRACEBACK).write_text(failure.trace)
        line += f" (traceback in {run_dir / TRACEBACK})"
    record = {"role": failure.role, "rank": failure.rank, "cause": failure.cause.value, "line": line}
    (run_dir / REPORT).write_text(json.dumps(record) + "\n")
    return line


def read_report(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / REPORT).read_text())
    except (OSError, ValueError):  # none: rank 0 died before it could write one
        return None
