"""Synthetic arithmetic problems and matching reasoning traces (the CPU demo and the tests).

`addition_problems` writes RL problems; `addition_traces` writes SFT cold-start traces in the
template's format (`<think>` working `</think>` `\\boxed{}`), tokenised exactly as rollouts are, so
the cold start teaches the format that the reward checks.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from megatron_rl.data.prompts import get_template, render_prompt_ids
from megatron_rl.records import Problem


PROMPT = "What is {a} + {b}?"


def addition_problem(index: int, a: int, b: int, prompt_format: str = PROMPT) -> Problem:
    prompt = prompt_format.format(a=a, b=b)
    return Problem(f"add-{index}", prompt, {"kind": "math", "answer": str(a + b), "problem": prompt})


def addition_problems(path: Path, n: int, max_operand: int = 99, seed: int = 0, prompt_format: str = PROMPT) -> Path:
    rng = random.Random(seed)
    with Path(path).open("w") as f:
        for i in range(n):
            p = addition_problem(i, rng.randint(0, max_operand), rng.randint(0, max_operand), prompt_format)
            f.write(json.dumps({"id": p.problem_id, "prompt": p.prompt, "answer": p.task["answer"]}) + "\n")
    return Path(path)


def _worked_sum(a: int, b: int) -> str:
    """Column addition written out, e.g. `37 + 48: 7 + 8 = 15, 30 + 40 = 70, 70 + 15 = 85`."""
    units, tens = a % 10 + b % 10, (a - a % 10) + (b - b % 10)
    return f"{a} + {b}: {a % 10} + {b % 10} = {units}, {a - a % 10} + {b - b % 10} = {tens}, {tens} + {units} = {a + b}"


def addition_traces(path: Path, tokenizer, n: int, template: str, max_operand: int = 99, seed: int = 1,
                    worked: bool = False) -> Path:
    """SFT examples {"prompt_ids", "completion_ids"} whose completion follows the template's prefix;
    `worked` writes the column addition out instead of the bare sum."""
    tpl = get_template(template)
    rng = random.Random(seed)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    with Path(path).open("w") as f:
        for i in range(n):
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
            problem = addition_problem(i, a, b)
            working = _worked_sum(a, b) if worked else f"{a} + {b} = {a + b}"
            completion = f"{working}\n</think>\nThe answer is \\boxed{{{a + b}}}."
            f.write(json.dumps({
                "prompt_ids": render_prompt_ids(tokenizer, problem, tpl),
                "completion_ids": tokenizer(completion, add_special_tokens=False).input_ids + eos}) + "\n")
    return Path(path)
