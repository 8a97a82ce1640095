"""A scripted environment for tests: observations are a fixed function of the turns, no model needed."""
from __future__ import annotations

import time
from typing import Any

from megatron_rl.env.base import EnvFailure, Environment, Message, StepResult


class Echo(Environment):
    """Echoes the model's turns back for ``turns`` turns, then ends.

    - ``reset(task)`` -> ``[{"role": "user", "content": f"Echo: reply {turns} times."}]``
    - step k (1-based) of ``turns``: for k < turns the observation is
      ``[{"role": "user", "content": f"echo {k}: {turn.strip()}"}]``, done False; at k == turns done
      with ``reward`` (None: the last turn is graded by ``reward.score``; a float: that reward).
      ``info`` is ``{"turn": k}``. A step after done, before reset or after close: RuntimeError.
    - ``fail_at``: step number that raises EnvFailure (to test how callers handle a broken environment).
    - ``delay_s``: seconds each step takes (a tool's latency).
    ``closed``: close() was called (for tests of a caller's cleanup).
    """

    def __init__(self, turns: int = 2, reward: float | None = None, fail_at: int | None = None, delay_s: float = 0.0):
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"Echo: turns must be an int >= 1, got {turns!r}")
        if not isinstance(delay_s, (int, float)) or delay_s < 0:
            raise ValueError(f"Echo: delay_s must be a number >= 0, got {delay_s!r}")
        self.turns, self.reward, self.fail_at, self.delay_s = turns, reward, fail_at, delay_s
        self.k = 0
        self.running = False
        self.closed = False

    def reset(self, task: dict[str, Any]) -> list[Message]:
        self.k, self.running = 0, True
        return [{"role": "user", "content": f"Echo: reply {self.turns} times."}]

    def step(self, turn: str) -> StepResult:
        if not self.running:
            raise RuntimeError("Echo.step: not running (before reset, after done or after close)")
        self.k += 1
        time.sleep(self.delay_s)
        if self.k == self.fail_at:
            raise EnvFailure(f"Echo: scripted failure at step {self.k}")
        if self.k < self.turns:
            return StepResult([{"role": "user", "content": f"echo {self.k}: {turn.strip()}"}],
                              info={"turn": self.k})
        self.running = False
        return StepResult(done=True, reward=self.reward, info={"turn": self.k})

    def close(self) -> None:
        self.running, self.closed = False, True
