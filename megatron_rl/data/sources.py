"""Problem sources for training: JSONL files and reasoning-gym generators (shipped in its wheel).

Each source yields `records.Problem` with a task dict in the schema of `megatron_rl.reward.types`
(validated here, so a bad problem set fails at load time with its line number, not mid-run).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from megatron_rl.config import DataConfig
from megatron_rl.records import Problem


class DataError(ValueError):
    """A problem set cannot be read or a problem does not follow the task schema."""


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


def read_jsonl(path: str | Path) -> list[Problem]:
    """Lines of {"id"?, "prompt" | "problem", "task" | ("answer" | "tests", "kind"?), "language"?}."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"problem file not found: {path}")
    problems = []
    for lineno, line in utf8_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON: {e}") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: each line must be a JSON object")
        prompt = row.get("prompt", row.get("problem"))
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{where}: missing 'prompt' (or 'problem') text")
        task = row.get("task")
        if task is None:
            kind = row.get("kind", "code" if "tests" in row else "math")
            task = {"kind": kind, "problem": prompt}
            task.update({k: row[k] for k in ("answer", "tests", "language") if k in row})
            if kind == "math" and "answer" in task:
                task["answer"] = str(task["answer"])
        problems.append(_validated(Problem(str(row.get("id", f"{path.stem}-{lineno}")), prompt, task,
                                           row.get("lang")), where))
    if not problems:
        raise DataError(f"{path}: no problems")
    return problems


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
        yield from read_jsonl(cfg.path)
    elif cfg.source == "reasoning_gym":
        yield from reasoning_gym_problems(cfg.task, cfg.size, cfg.seed)
    elif cfg.source == "champ":
        from megatron_rl.data.champ import champ_problems

        yield from champ_problems()[: cfg.size]
    else:  # humaneval: graded by its own harness (data/humaneval.py), not by reward.score
        raise DataError("data source 'humaneval' is evaluation-only (megatron-rl evaluate --source humaneval): "
                        "its tests are a Python check() harness that the training reward does not run")
