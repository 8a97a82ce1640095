"""The problem stream: epochs over the problem set, re-queued problems, curriculum.

State (cursor, epoch, re-queue, pass rates) is exported for checkpoints, so a resumed run continues
with the next problem, never repeating or skipping one.
"""
from __future__ import annotations

import random
from collections import deque
from typing import Any

from megatron_rl.records import Problem


class ProblemQueue:
    """Yields problems epoch by epoch (a seeded shuffle per epoch); re-queued problems come first.

    Curriculum (Magistral raises difficulty as training goes): with `drop_solved_above`, a problem
    whose last group's pass rate reached it is skipped in later epochs.
    """

    def __init__(self, problems: list[Problem], seed: int = 0, drop_solved_above: float | None = None):
        if not problems:
            raise ValueError("the problem set is empty")
        ids = [p.problem_id for p in problems]
        if len(set(ids)) != len(ids):
            raise ValueError("problem ids must be unique")
        self.problems = {p.problem_id: p for p in problems}
        self.ids = ids
        self.seed = seed
        self.drop_solved_above = drop_solved_above
        self.epoch, self.cursor = 0, 0
        self.requeued: deque[str] = deque()
        self.pass_rate: dict[str, float] = {}
        self.issued = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[str]:
        order = list(self.ids)
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _solved(self, pid: str) -> bool:
        return self.drop_solved_above is not None and self.pass_rate.get(pid, 0.0) >= self.drop_solved_above

    def next(self) -> Problem:
        if self.requeued:
            self.issued += 1
            return self.problems[self.requeued.popleft()]
        for _ in range(2 * len(self.ids) + 1):
            if self.cursor >= len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._epoch_order(self.epoch)
            pid = self._order[self.cursor]
            self.cursor += 1
            if self.epoch == 0 or not self._solved(pid):
                self.issued += 1
                return self.problems[pid]
        raise RuntimeError("every problem is solved above the curriculum threshold: nothing left to train on")

    def requeue(self, problem: Problem) -> None:
        self.requeued.append(problem.problem_id)

    def record(self, problem_id: str, pass_rate: float) -> None:
        self.pass_rate[problem_id] = pass_rate

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "requeued": list(self.requeued),
                "pass_rate": dict(self.pass_rate), "issued": self.issued}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [p for p in state["requeued"] if p not in self.problems]
        if missing:
            raise ValueError(f"checkpoint refers to problems not in this problem set, e.g. {missing[:3]}")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order(self.epoch)
        self.requeued = deque(state["requeued"])
        self.pass_rate = dict(state["pass_rate"])
        self.issued = state["issued"]

