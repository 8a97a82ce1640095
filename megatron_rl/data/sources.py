"""Problem sources for training: JSONL and parquet files, reasoning-gym generators (shipped in its wheel).

Each source yields `records.Problem` with a task dict in the schema of `megatron_rl.reward.types`
(validated here, so a bad problem set fails at load time with its line or row number, not mid-run).
Rows become problems in `data.rows` under the column names of the `data` config. JSONL is read line by
line here (exact JSON types, line numbers in errors); parquet through HF `datasets`, whose Arrow
tables give a column that a row lacks as null (such nulls count as absent).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from megatron_rl.config.data import DataConfig
from megatron_rl.data.rows import DataError, problem_from_row
from megatron_rl.records import Problem

__all__ = ["DataError", "iter_problems", "read_jsonl", "read_parquet", "read_problems", "reasoning_gym_problems",
           "json_object_lines", "utf8_lines"]


def _validated(problem: Problem, where: str) -> Problem:
    from megatron_rl.reward.types import TaskError, parse_task

    try:
        parse_task(problem.task)
    except TaskError as e:
        raise DataError(f"{where}: {e}") from None
    return problem


def utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a UTF-8 text file; DataError naming the file and line on a
    line that is not UTF-8 (read as text, such a byte would escape as a bare UnicodeDecodeError)."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}); save the file as UTF-8") from None


def json_object_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSONL file; DataError naming the file and line on
    a line that is not UTF-8, not JSON or not a JSON object."""
    for lineno, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON: {e}") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
        yield lineno, row


def _not_found(path: str | Path, key: str) -> DataError:
    """Names the setting the path came from (`key`, e.g. data.path) and where a relative path starts:
    a user who typed the path on a command line or in a YAML file must find it again."""
    named = f"{key}: " if key else ""
    start = "" if Path(path).is_absolute() else f" (relative to {Path.cwd()})"
    return DataError(f"{named}problem file not found: {path}{start}")


def read_jsonl(path: str | Path, cfg: DataConfig | None = None, *, key: str = "") -> list[Problem]:
    """Lines of {"id"?, prompt, "task" | (answer | tests, "kind"?, language?), "lang"?, ...} under the
    column names of `cfg` (default: prompt or problem, answer, tests, language). `key`: the setting
    `path` came from, named when the file does not exist."""
    cfg = cfg if cfg is not None else DataConfig()
    path = Path(path)
    if not path.is_file():
        raise _not_found(path, key)
    problems = []
    for lineno, row in json_object_lines(path):
        problems.append(problem_from_row(row, f"{path}:{lineno}", f"{path.stem}-{lineno}", cfg))
    if not problems:
        raise DataError(f"{path}: no problems")
    return problems


def read_parquet(path: str | Path, cfg: DataConfig | None = None, *, key: str = "") -> list[Problem]:
    """Rows of a parquet file (or of a glob of them, file by file: each its own schema) through HF
    datasets, under `cfg`'s column names (`key` as for read_jsonl)."""
    import glob

    cfg = cfg if cfg is not None else DataConfig()
    files = sorted(glob.glob(str(path))) if any(c in str(path) for c in "*?[") else [str(path)]
    if not files or not all(Path(f).is_file() for f in files):
        raise _not_found(path, key)
    problems = []
    for file in files:
        rows = _parquet_rows(file)
        problems += [problem_from_row({k: v for k, v in row.items() if v is not None}, f"{file}: row {i}",
                                      f"{Path(file).stem}-{i}", cfg) for i, row in enumerate(rows)]
    if not problems:
        raise DataError(f"{path}: no problems")
    return problems


def _parquet_rows(file: str) -> list[dict]:
    import tempfile

    import datasets

    datasets.disable_progress_bars()
    try:  # a private cache: nothing is left in ~/.cache/huggingface
        with tempfile.TemporaryDirectory(prefix="megatron_rl_parquet_") as cache:
            return datasets.Dataset.from_parquet(file, cache_dir=cache, keep_in_memory=True).to_list()
    except Exception as e:  # pyarrow/datasets errors on a file that is no parquet
        cause = e.__cause__ or e  # datasets wraps the reader's error in DatasetGenerationError
        why = (str(cause).splitlines() or [""])[0][:200]
        raise DataError(f"{file}: cannot read as parquet: {type(cause).__name__}: {why}") from None


def read_problems(path: str | Path, cfg: DataConfig | None = None, *, key: str = "") -> list[Problem]:
    """A JSONL or parquet problem file, told apart by its suffix (.parquet, or a glob of them)."""
    reader = read_parquet if str(path).endswith(".parquet") else read_jsonl
    return reader(path, cfg, key=key)


def reasoning_gym_problems(task: str, size: int, seed: int, **kwargs) -> list[Problem]:
    """Procedural math problems from reasoning-gym; answers are graded by our math verifier."""
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **kwargs)
    except (KeyError, ValueError) as e:
        raise DataError(f"reasoning-gym task {task!r}: {e}") from None
    return [_validated(Problem(f"{task}-{seed}-{i}", item["question"],
                               {"kind": "math", "answer": str(item["answer"]), "problem": item["question"]}),
                       f"reasoning-gym {task}[{i}]")
            for i, item in enumerate(dataset)]


def iter_problems(cfg: DataConfig) -> Iterator[Problem]:
    """The configured problem set, in a fixed order (the controller keeps the cursor)."""
    if cfg.source == "jsonl":
        yield from read_jsonl(cfg.path, cfg, key="data.path")
    elif cfg.source == "parquet":
        yield from read_parquet(cfg.path, cfg, key="data.path")
    elif cfg.source == "reasoning_gym":
        yield from reasoning_gym_problems(cfg.task, cfg.size, cfg.seed)
    elif cfg.source == "champ":
        from megatron_rl.data.champ import champ_problems

        yield from champ_problems()[: cfg.size]
    else:  # humaneval: the held-out benchmark (data/humaneval.py grades it as the reward grades call tests)
        raise DataError("data source 'humaneval' is evaluation-only (megatron-rl evaluate --source humaneval): "
                        "it is the held-out benchmark; train on problems of its form from a jsonl/parquet file "
                        "(tests = check(candidate) code, entry_point column)")
