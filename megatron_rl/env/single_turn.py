"""A single-turn task as a one-turn episode: the same path as multi-turn, with nothing between turns."""
from __future__ import annotations

from typing import Any

from megatron_rl.env.base import Environment, Message, StepResult


class SingleTurn(Environment):
    """``reset`` shows nothing (the prompt is the task's, rendered by the caller); the first ``step``
    ends the episode with ``reward=None``: the turn is graded by ``reward.score(task, turn)``, exactly
    as a single-turn sample is. A second ``step`` is a caller bug (RuntimeError)."""

    def __init__(self) -> None:
        self._state = "new"

    def reset(self, task: dict[str, Any]) -> list[Message]:
        self._state = "running"
        return []

    def step(self, turn: str) -> StepResult:
        if self._state != "running":
            raise RuntimeError(f"SingleTurn.step: the episode is {self._state} (one step per reset)")
        self._state = "done"
        return StepResult(done=True)

    def close(self) -> None:
        self._state = "closed"
