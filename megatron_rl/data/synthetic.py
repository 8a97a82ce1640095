"""Synthetic arithmetic problems and matching reasoning traces (the CPU demo, the tool demo and the tests).

`addition_problems` writes RL problems; `addition_traces` writes SFT cold-start traces in the
template's format (`<think>` working `</think>` `\\boxed{}`), tokenised exactly as rollouts are, so
the cold start teaches the format that the reward checks. The multiplication part does the same for
the tool demo (examples/tool_demo_data.py), with traces that call the python tool: multi-turn records
laid out token for token as an episode, the tool's output masked out of the loss (`episode_trace`).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from megatron_rl.data.prompts import PromptTemplate, get_template, render_prompt_ids
from megatron_rl.data.turns import ChatTurns
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


# ---------------------------------------------------------------------------------------- multiplication
# The tool demo (docs/experiments.md "Tool use"): 3-digit x 3-digit products, which a 135M model cannot
# work out in its head but can hand to the python tool environment (env.name: python).

MULTIPLY = "What is {a} * {b}?"


def multiplication_problem(index: int, a: int, b: int) -> Problem:
    prompt = MULTIPLY.format(a=a, b=b)
    return Problem(f"mul-{index}", prompt, {"kind": "math", "answer": str(a * b), "problem": prompt})


def multiplication_pairs(n: int, seed: int = 0, low: int = 100, high: int = 999) -> list[tuple[int, int]]:
    """`n` distinct operand pairs, each operand uniform in [low, high]."""
    if n > (high - low + 1) ** 2:
        raise ValueError(f"only {(high - low + 1) ** 2} distinct pairs in [{low}, {high}], asked for {n}")
    rng = random.Random(seed)
    pairs: dict[tuple[int, int], None] = {}  # a dict keeps the draw order
    while len(pairs) < n:
        pairs[(rng.randint(low, high), rng.randint(low, high))] = None
    return list(pairs)


def write_multiplication_problems(path: Path, pairs: list[tuple[int, int]], first_index: int = 0) -> Path:
    with Path(path).open("w") as f:
        for i, (a, b) in enumerate(pairs, first_index):
            p = multiplication_problem(i, a, b)
            f.write(json.dumps({"id": p.problem_id, "prompt": p.prompt, "answer": p.task["answer"]}) + "\n")
    return Path(path)


def tool_call_text(code: str) -> str:
    """One call of the python tool in the Hermes format the environment reads (env/python_tool.py)."""
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


def worked_product(a: int, b: int) -> str:
    """Long multiplication by the digits of b, e.g. `123 * 405 = 123 * 400 + 123 * 5 = 49200 + 615 = 49815`."""
    parts = [int(d) * 10 ** k for k, d in enumerate(reversed(str(b))) if d != "0"][::-1]
    if len(parts) == 1:
        return f"{a} * {b} = {a * b}"
    terms = " + ".join(f"{a} * {p}" for p in parts)
    return f"{a} * {b} = {terms} = {' + '.join(str(a * p) for p in parts)} = {a * b}"


def _answer(working: str, answer: int) -> str:
    """A final turn after the template's `<think>\\n` prefix: the working, then the boxed answer."""
    return f"{working}\n</think>\nThe answer is \\boxed{{{answer}}}."


def multiplication_turns(a: int, b: int, tool: bool) -> tuple[list[str], list[list[dict[str, str]]]]:
    """(model turns, the observation after each but the last) of a solved trace: with the tool, a call
    that prints the product, the tool's output, then the answer; without, the long multiplication."""
    if not tool:
        return [_answer(worked_product(a, b), a * b)], []
    return ([tool_call_text(f"print({a} * {b})"), _answer(f"{a} * {b} = {a * b}", a * b)],
            [[{"role": "tool", "content": str(a * b)}]])


def episode_trace(tokenizer, template: PromptTemplate, problem: Problem, turns: list[str],
                  observations: list[list[dict[str, str]]]) -> dict[str, list[int]]:
    """An SFT record laid out token for token as the turn loop lays out an episode (rollout/episode.py):
    the rendered prompt; each turn's ids and stop token (trained); each observation's ids from the chat
    template, with the template's assistant prefix (not trained: loss_mask 0)."""
    chat = ChatTurns(tokenizer, template)
    ids: list[int] = []
    mask: list[int] = []
    for k, turn in enumerate(turns):
        sampled = tokenizer(turn, add_special_tokens=False).input_ids + [chat.stop_ids[0]]
        seen = chat.observation_ids(observations[k]) if k < len(observations) else []
        ids += sampled + seen
        mask += [1] * len(sampled) + [0] * len(seen)
    return {"prompt_ids": render_prompt_ids(tokenizer, problem, template), "completion_ids": ids, "loss_mask": mask}


def multiplication_traces(path: Path, tokenizer, template: PromptTemplate, pairs: list[tuple[int, int]],
                          tool: bool) -> Path:
    """SFT records (`episode_trace`) solving each pair, with the python tool or by long multiplication."""
    with Path(path).open("w") as f:
        for i, (a, b) in enumerate(pairs):
            turns, observations = multiplication_turns(a, b, tool)
            f.write(json.dumps(episode_trace(tokenizer, template, multiplication_problem(i, a, b), turns,
                                             observations)) + "\n")
    return Path(path)
