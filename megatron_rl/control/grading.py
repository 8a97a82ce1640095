"""Grading from the controller's point of view: submit items, poll finished breakdowns.

`LocalGrader` runs a `reward.VerifierPool` in a background thread of the controller process (the
pool's worker processes do the grading); `verifier_loop` serves the same pool on a dedicated
verifier rank, fed over MPI by the controller (see controller.py). Both survive hung items
(per-item timeout -> reward 0, status "timeout") and crashed grading processes (re-issued).

Each item is graded with the overlong-penalty window of the length stage its rollout was requested
under (`GradeItem.l_max` / `l_cache`), never the stage current when it is graded: with asynchronous generation a
sample requested before a stage switch is often graded after it.
"""
from __future__ import annotations

import queue
import threading
import time

from megatron_rl.config import RewardConfig
from megatron_rl.control.protocol import GradeItem, Tag
from megatron_rl.reward import VerifierPool


def _grade(pool: VerifierPool, items: list[GradeItem]) -> list[tuple[tuple[str, int], dict]]:
    """Grade a GRADE message (what both LocalGrader and verifier ranks run)."""
    results = pool.map([{"task": it.task, "response": it.response, "num_tokens": it.num_tokens,
                         "l_max": it.l_max, "l_cache": it.l_cache}
                        for it in items])
    return [(it.key, r.to_dict()) for it, r in zip(items, results)]


class LocalGrader:
    def __init__(self, config: RewardConfig):
        self.pool = VerifierPool(config).start()
        self._in: queue.Queue[GradeItem | None] = queue.Queue()
        self._out: queue.Queue[tuple[tuple[str, int], dict]] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="grader", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while True:
                first = self._in.get()
                if first is None:
                    return
                items = [first]
                while not self._in.empty():  # grade whatever has accumulated, in parallel
                    nxt = self._in.get()
                    if nxt is None:
                        self._in.put(None)
                        break
                    items.append(nxt)
                for result in _grade(self.pool, items):
                    self._out.put(result)
        except BaseException as e:  # surfaced by poll(): grading must never fail silently
            self._error = e

    def submit(self, items: list[GradeItem]) -> None:
        for it in items:
            self._in.put(it)

    def poll(self) -> list[tuple[tuple[str, int], dict]]:
        if self._error is not None:
            raise RuntimeError(f"grading thread failed: {self._error}") from self._error
        out = []
        while not self._out.empty():
            out.append(self._out.get())
        return out

    def close(self) -> None:
        self._in.put(None)
        self._thread.join(timeout=30)
        self.pool.close()


def verifier_loop(comm, config: RewardConfig, poll_s: float = 0.01) -> None:
    """Body of a verifier rank: grade GRADE lists from the controller until STOP."""
    from mpi4py import MPI

    status = MPI.Status()
    with VerifierPool(config) as pool:
        while True:
            if not comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=status):
                time.sleep(poll_s)
                continue
            msg = comm.recv(source=0, tag=status.Get_tag())
            if status.Get_tag() == Tag.STOP:
                return
            comm.send(_grade(pool, msg), dest=0, tag=Tag.GRADED)
