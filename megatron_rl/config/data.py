"""The `data` section of the config tree (megatron_rl.config): where problems come from, how a row
becomes a problem, and how its prompt is rendered for the generators (megatron_rl.data)."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.tree import check

SOURCES = ("reasoning_gym", "jsonl", "parquet", "humaneval", "champ")


@dataclass
class DataConfig:
    """Problem source (megatron_rl.data)."""

    source: str = "reasoning_gym"  # reasoning_gym | jsonl | parquet | humaneval | champ
    path: str | None = None  # JSONL or parquet file (or a glob of parquet files) for source=jsonl / parquet
    task: str = "basic_arithmetic"  # reasoning-gym task name
    size: int = 1000
    seed: int = 0
    # Template name in megatron_rl.data.prompts (magistral, magistral_prefill, short, short_python, none) or, when it holds whitespace, the system prompt's own text
    system_prompt: str = "magistral"
    # UTF-8 text file whose content replaces the system text of system_prompt's template (its assistant prefix stays)
    system_prompt_file: str | None = None
    # Keyword arguments of the tokenizer's apply_chat_template, e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    # Column of a jsonl/parquet row holding the prompt: a string, or a list of {role, content} chat messages; a dotted path reads a nested field
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # column of a math task's reference answer (dotted path: nested field)
    # Column of a code task's tests: a list of {input, output} (stdin/stdout), or Python function-call tests (call dicts, assert code; docs/reward.md); JSON text is decoded (dotted path: nested field)
    tests_key: str = "tests"
    language_key: str = "language"  # column of a code task's programming language, python or cpp (dotted path: nested field)
    entry_point_key: str = "entry_point"  # column naming the function a code task's tests call `candidate` (HumanEval's check(candidate)); optional (dotted path: nested field)
    # Curriculum: drop problems whose recent pass rate reached this (None = keep everything).
    drop_solved_above: float | None = None
    # Held-out evaluation set (JSONL, or parquet by its .parquet suffix; same columns and checks as path), evaluated every run.eval_every updates.
    eval_path: str | None = None

    def validate(self, key: str) -> None:
        check(self.source in SOURCES, f"{key}.source", f"must be one of {', '.join(SOURCES)}")
        check(self.source not in ("jsonl", "parquet") or bool(self.path), f"{key}.path",
              f"required when source is {self.source}")
        check(self.size >= 1, f"{key}.size", "must be >= 1")
        check(self.drop_solved_above is None or 0 < self.drop_solved_above <= 1,
              f"{key}.drop_solved_above", "must lie in (0, 1] or be null")
        for name in ("prompt_key", "answer_key", "tests_key", "language_key", "entry_point_key"):
            check(bool(getattr(self, name).strip()), f"{key}.{name}", "must name a column")
        check(bool(self.system_prompt.strip()), f"{key}.system_prompt", "must be a template name or text")
        # the template exists and system_prompt_file reads: pre-flight (control.preflight.check_config)
