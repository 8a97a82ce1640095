"""The verifier ranks as the controller sees them: who gets the next grading request, what each was
sent and has not answered, and which are dead or hung.

A verifier rank grades its requests one after another, so only the oldest unanswered one is being
graded: the rank is hung when that request is not answered within its reply timeout, counted from
when it became the oldest (`reward.verifier_reply_timeout_s`, or derived from the pool's own limits:
`reply_timeout_s`). A hung or failed rank gets no more requests and its unanswered items go to the
live ones; a hung rank that answers after all is live again (its late verdicts of re-sent items are
duplicates the grading ledger ignores).
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from megatron_rl.config import RewardConfig
from megatron_rl.control.protocol import Cause, GradeItem, Key, RunFailed

REPLY_SLACK_S = 30.0  # message transfer and a grading process restart, on top of the grading itself
POOL_ATTEMPTS = 2  # reward.VerifierPool grades an item again once when its grading process crashed


def reply_timeout_s(cfg: RewardConfig, n_items: int) -> float:
    """How long a verifier rank may take to answer a request of `n_items`: the key when set, else each
    round of `verifier_workers` items may run into the per-item limit on both pool attempts."""
    if cfg.verifier_reply_timeout_s is not None:
        return cfg.verifier_reply_timeout_s
    rounds = math.ceil(max(1, n_items) / cfg.verifier_workers)
    return POOL_ATTEMPTS * rounds * cfg.verifier_item_timeout_s + REPLY_SLACK_S


class VerifierRanks:
    def __init__(self, ranks: list[int], cfg: RewardConfig, clock: Callable[[], float] = time.monotonic):
        self.ranks, self.cfg, self.clock = list(ranks), cfg, clock
        self.out: dict[int, deque[dict[Key, GradeItem]]] = {r: deque() for r in ranks}  # unanswered, oldest first
        self.deadline: dict[int, float] = {}  # for the oldest unanswered request of each busy rank
        self.failed: set[int] = set()  # sent a WorkerFailure: never used again
        self.hung: set[int] = set()  # missed a deadline: used again once it answers
        self._next = 0

    def live(self) -> list[int]:
        return [r for r in self.ranks if r not in self.failed and r not in self.hung]

    def pick(self, why: str = "") -> int:
        """The rank for the next request: the live ones in turn."""
        live = self.live()
        if not live:
            raise RunFailed(f"no live verifier rank is left{why}", Cause.LOST)
        self._next += 1
        return live[self._next % len(live)]

    def sent(self, rank: int, items: list[GradeItem]) -> None:
        queue = self.out[rank]
        queue.append({it.key: it for it in items})
        if len(queue) == 1:
            self.deadline[rank] = self.clock() + reply_timeout_s(self.cfg, len(items))

    def answered(self, rank: int, keys: list[Key]) -> None:
        """A Graded from `rank`: its oldest request is done; the next one's clock starts."""
        if rank in self.failed:
            return
        self.hung.discard(rank)
        queue = self.out[rank]
        answered = {tuple(k) for k in keys}
        while queue and set(queue[0]) <= answered:
            queue.popleft()
        if queue:
            self.deadline[rank] = self.clock() + reply_timeout_s(self.cfg, len(queue[0]))
        else:
            self.deadline.pop(rank, None)

    def overdue(self) -> list[tuple[int, list[GradeItem]]]:
        """Ranks that missed their deadline, now counted hung, with the items they hold."""
        now = self.clock()
        late = [r for r, d in self.deadline.items() if d < now and r not in self.hung]
        out = []
        for rank in late:
            self.hung.add(rank)
            out.append((rank, self._take(rank)))
        return out

    def lost(self, rank: int) -> list[GradeItem]:
        """A rank that failed: never used again; the items it holds."""
        self.failed.add(rank)
        return self._take(rank)

    def _take(self, rank: int) -> list[GradeItem]:
        items = [it for request in self.out[rank] for it in request.values()]
        self.out[rank].clear()
        self.deadline.pop(rank, None)
        return items
