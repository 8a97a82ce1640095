"""Logging of every megatron_rl process: one format with the time, the process's role and rank, and a level.

    08:41:07 [controller r0] INFO run directory runs/demo (3 ranks)
    08:41:09 [convert] ERROR checkpoint ckpt/ has no manifest.json

`setup(role, rank, level)` is called once per process (the `megatron-rl` command with its subcommand
as the role; each MPI rank of a run with its role and rank). Modules log through `get_logger(__name__)`;
only the `megatron_rl` logger gets the handler, so third-party loggers keep their own settings. The
level comes from `--log-level`, else the MEGATRON_RL_LOG_LEVEL environment variable (which `setup`
exports, so the ranks a command starts log at its level), else INFO. Messages go to stderr through
tqdm's writer when a progress bar is on screen, so a log line never breaks a bar.
"""
from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "MEGATRON_RL_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
PACKAGE = "megatron_rl"
_FORMAT = "%(asctime)s [%(tag)s] %(levelname)s %(message)s"


class _StderrHandler(logging.Handler):
    """Writes to the sys.stderr of the moment (tests and redirections replace it) and, while a tqdm
    bar is shown, above the bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            tqdm = sys.modules.get("tqdm")  # only when some code already drew bars with it
            if tqdm is not None and getattr(tqdm.tqdm, "_instances", None):
                tqdm.tqdm.write(msg, file=sys.stderr)
            else:
                sys.stderr.write(msg + "\n")
                sys.stderr.flush()
        except Exception:  # a broken stderr must not take the process down
            self.handleError(record)


class _TagFilter(logging.Filter):
    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        record.tag = self.tag
        return True


def resolve_level(level: str | None = None) -> str:
    """The level name from the argument, else the environment, else INFO; ValueError for an unknown name."""
    name = (level or os.environ.get(LEVEL_ENV) or "INFO").upper()
    if name not in LEVELS:
        raise ValueError(f"log level {name!r}: expected one of {', '.join(LEVELS)} (--log-level or {LEVEL_ENV})")
    return name


def setup(role: str, rank: int | None = None, level: str | None = None) -> logging.Logger:
    """Configure the package logger of this process (idempotent: a second call replaces the first's
    handler, e.g. in tests that call the CLI several times)."""
    name = resolve_level(level)
    os.environ[LEVEL_ENV] = name  # the processes this one starts (mpiexec ranks) inherit the level
    logger = logging.getLogger(PACKAGE)
    for old in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(old)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_TagFilter(role if rank is None else f"{role} r{rank}"))
    logger.addHandler(handler)
    logger.setLevel(name)
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger of a module (`get_logger(__name__)`); under `megatron_rl` it uses `setup`'s handler."""
    return logging.getLogger(name)
