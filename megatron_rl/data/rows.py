"""One row of a problem file (a JSONL line, a parquet record) -> `records.Problem`, under the column
names of the `data` config (`prompt_key`, `answer_key`, `tests_key`, `language_key`; a dotted name
reads a nested field, e.g. verl's `reward_model.ground_truth`).

A row gives its prompt as text or as chat messages (a list of {role, content}), and its task either
whole (a `task` column in the schema of megatron_rl.reward.types) or through those columns (kind
`code` when it has tests, else `math`; the tests may be JSON text, and `entry_point_key` names the
function of HumanEval-style `check(candidate)` tests). Columns nothing else reads go under the task's
`meta`, where a `reward.custom` plug-in finds them. Errors name the row (`where`) and the config key
of the column.
"""
from __future__ import annotations

import json
from typing import Any

from megatron_rl.config.data import DataConfig
from megatron_rl.errors import InputError
from megatron_rl.records import Problem

ROLES = ("system", "user", "assistant")
_MISSING = object()


class DataError(InputError, ValueError):
    """A problem set cannot be read or a problem does not follow the task schema."""


def field_at(row: dict[str, Any], dotted: str) -> Any:
    """row["a"]["b"] for "a.b" (a column literally named "a.b" first); _MISSING when absent or null."""
    if dotted in row:
        value = row[dotted]
    else:
        value = row
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                return _MISSING
            value = value[part]
    return _MISSING if value is None else value


def chat_messages(value: list, where: str, key: str) -> list[dict[str, str]]:
    """Validated chat messages; the last user message is the problem text."""
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: prompt column {key!r} (data.prompt_key) message {i} must be "
                            f"{{'role': one of {list(ROLES)}, 'content': text}}, got {str(m)[:80]}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise DataError(f"{where}: prompt column {key!r} (data.prompt_key) has no user message with text")
    return out


def _prompt(row: dict, where: str, cfg: DataConfig) -> tuple[str, list[dict[str, str]] | None, set[str]]:
    key = cfg.prompt_key
    value = field_at(row, key)
    if value is _MISSING and key == "prompt" and field_at(row, "problem") is not _MISSING:
        key, value = "problem", field_at(row, "problem")  # the problem files of the tools write "problem"
    if isinstance(value, list):
        messages = chat_messages(value, where, key)
        return [m["content"] for m in messages if m["role"] == "user"][-1], messages, {key}
    if not isinstance(value, str) or not value.strip():
        got = "missing" if value is _MISSING else f"not text ({type(value).__name__})"
        raise DataError(f"{where}: prompt column {key!r} (data.prompt_key) is {got}: a string or a list of "
                        f"{{role, content}} messages is needed")
    return value, None, {key}


def _task(row: dict, prompt: str, where: str, cfg: DataConfig) -> tuple[dict[str, Any], set[str]]:
    if isinstance(row.get("task"), dict):
        return {k: v for k, v in row["task"].items() if v is not None}, {"task"}  # parquet fills absent keys with null
    answer, tests = field_at(row, cfg.answer_key), field_at(row, cfg.tests_key)
    kind = row.get("kind") or ("code" if tests is not _MISSING else "math")
    task: dict[str, Any] = {"kind": kind, "problem": prompt}
    if kind == "math":
        if answer is _MISSING:
            raise DataError(f"{where}: answer column {cfg.answer_key!r} (data.answer_key) is missing: a math "
                            f"problem needs its reference answer")
        task["answer"] = str(answer)
    elif kind == "code":
        if tests is _MISSING:
            raise DataError(f"{where}: tests column {cfg.tests_key!r} (data.tests_key) is missing: a code "
                            f"problem needs its tests")
        task["tests"] = _json_text(tests, where, cfg)
        for key, column in (("language", cfg.language_key), ("entry_point", cfg.entry_point_key)):
            value = field_at(row, column)
            if value is not _MISSING:
                task[key] = value
    return task, {"kind", cfg.answer_key, cfg.tests_key, cfg.language_key, cfg.entry_point_key}


def _json_text(tests: Any, where: str, cfg: DataConfig) -> Any:
    """Tests stored as JSON text (a parquet column cannot hold arguments of mixed types), decoded; any
    other text is assert code."""
    if not (isinstance(tests, str) and tests.lstrip()[:1] in ("[", "{")):
        return tests
    try:
        return json.loads(tests)
    except ValueError as e:
        raise DataError(f"{where}: tests column {cfg.tests_key!r} (data.tests_key) holds text that starts like "
                        f"JSON but is not: {e}") from None


# the column (and its config key) a task key comes from, for errors
_COLUMNS = {"tests": ("tests_key", "tests"), "entry_point": ("entry_point_key", "entry point"),
            "language": ("language_key", "language"), "answer": ("answer_key", "answer")}


def _task_error(e: Exception, where: str, cfg: DataConfig, from_columns: bool) -> DataError:
    """The task's schema error, naming the column and config key it came from when it names a task key."""
    key = getattr(e, "key", None)
    if not from_columns or key not in _COLUMNS:
        return DataError(f"{where}: {e}")
    setting, what = _COLUMNS[key]
    return DataError(f"{where}: {what} column {getattr(cfg, setting)!r} (data.{setting}): "
                     f"{str(e).removeprefix('code task: ').removeprefix('math task: ')}")


def problem_from_row(row: Any, where: str, default_id: str, cfg: DataConfig) -> Problem:
    """The problem of one row; DataError naming `where` (file and line or row) on a bad one."""
    from megatron_rl.reward.types import TaskError, parse_task

    if not isinstance(row, dict):
        raise DataError(f"{where}: each row must be an object/record, got {type(row).__name__}")
    prompt, messages, used = _prompt(row, where, cfg)
    task, task_cols = _task(row, prompt, where, cfg)
    used |= task_cols | {"id", "lang", "meta"}
    top = {k.split(".", 1)[0] for k in used}
    extra = {k: v for k, v in row.items() if k not in used and k not in top and v is not None}
    meta = {**(row["meta"] if isinstance(row.get("meta"), dict) else {}), **extra}
    if meta and "task" not in row:
        task["meta"] = meta
    try:
        parse_task(task)
    except TaskError as e:
        raise _task_error(e, where, cfg, "task" not in row) from None
    language = row.get("lang")
    return Problem(str(row.get("id", default_id)), prompt, task, language if isinstance(language, str) else None,
                   messages)
