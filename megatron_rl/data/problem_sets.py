"""The problem sets the offline commands (evaluate, filter, translate) read by name, and the JSONL rows
they read and write (a curation step's output is the next one's input)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_rl.records import Problem

SOURCES = ("jsonl", "reasoning_gym", "humaneval", "champ")


def load_problem_set(source: str, path: str | None = None, task: str = "basic_arithmetic", size: int = 100,
                     seed: int = 0, limit: int | None = None) -> list[Problem]:
    """The problems of `source` (one of SOURCES; `path` for jsonl, `task`/`size`/`seed` for reasoning-gym),
    the first `limit` of them when given."""
    from megatron_rl.data.sources import read_jsonl, reasoning_gym_problems

    if source == "jsonl":
        if not path:
            raise ValueError("--path is required with --source jsonl")
        problems = read_jsonl(path)
    elif source == "reasoning_gym":
        problems = reasoning_gym_problems(task, size, seed)
    elif source == "humaneval":
        from megatron_rl.data.humaneval import humaneval_problems

        problems = humaneval_problems()
    else:
        from megatron_rl.data.champ import champ_problems

        problems = champ_problems()
    return problems[:limit] if limit is not None else problems


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    from megatron_rl.data.sources import utf8_lines

    rows = []
    for lineno, line in utf8_lines(Path(path)):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
    return rows
