"""Problem sources and prompt templates; curation (filter_format, filter_difficulty, translate) and the
problem sets the offline commands read and write (problem_sets). The curation modules are imported directly."""
from megatron_rl.data.prompts import PromptTemplate, build_messages, get_template, render_prompt_ids
from megatron_rl.data.sources import (DataError, iter_problems, read_jsonl, read_parquet, read_problems,
                                      reasoning_gym_problems)

__all__ = ["PromptTemplate", "build_messages", "get_template", "render_prompt_ids", "DataError", "iter_problems",
           "read_jsonl", "read_parquet", "read_problems", "reasoning_gym_problems"]
