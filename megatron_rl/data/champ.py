"""CHAMP (270 competition math problems with answers, shipped in the `champ-dataset` wheel).

Answers are free-form ("C(10, 5), or equivalently 252", "No positive integer solutions"): the
closed form after "or equivalently" is used when given, and with `verifiable_only` (default) the
problems whose answer the math verifier cannot check reliably are dropped, with the same rules as
the format filter (`megatron_rl.data.filter_format.answer_verdict`).
"""
from __future__ import annotations

import re

from megatron_rl.records import Problem

_EQUIV = re.compile(r",?\s*or equivalently,?\s*", re.I)


def clean_answer(answer: str) -> str:
    parts = _EQUIV.split(answer.strip())
    return parts[-1].strip().rstrip(".")


def champ_problems(verifiable_only: bool = True, limit: int | None = None) -> list[Problem]:
    try:
        import champ_dataset
    except ImportError:
        raise ImportError("the champ source needs the champ-dataset package (env/requirements.lock)") from None
    from megatron_rl.data.filter_format import answer_verdict

    problems = []
    for key, p in champ_dataset.load("v0").problems.items():
        answer = clean_answer(p.answer)
        if verifiable_only and answer_verdict(answer) is not None:
            continue
        task = {"kind": "math", "answer": answer, "problem": p.text, "id": key, "source": "champ"}
        problems.append(Problem(key, p.text, task, "en"))
        if limit is not None and len(problems) >= limit:
            break
    return problems
