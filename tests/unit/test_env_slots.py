"""ToolSlots: at most `limit` tool runs at once in a process, resizable, with wait times and a peak."""
from __future__ import annotations

import threading
import time

import pytest

from megatron_rl.env import ToolSlots, shared_slots
from megatron_rl.env.slots import default_limit


def _run_many(slots: ToolSlots, n: int, hold_s: float) -> list[float]:
    waits: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(n)  # all ask at once, however late a thread starts

    def work():
        start.wait()
        with slots.hold() as waited:
            with lock:
                waits.append(waited)
            time.sleep(hold_s)

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(waits)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_at_most_limit_at_once(limit):
    slots = ToolSlots(limit)
    t0 = time.perf_counter()
    waits = _run_many(slots, 4, 0.2)
    took = time.perf_counter() - t0
    assert slots.peak == limit and slots.active == 0 and slots.waiting == 0
    rounds = -(-4 // limit)
    assert took >= 0.2 * rounds - 0.02
    assert sum(w > 0.1 for w in waits) == 4 - limit  # those that had to wait say so


def test_resize_timeout_and_shared():
    slots = ToolSlots(1)
    with slots.hold():
        with pytest.raises(TimeoutError, match="1 of 1 in use"):
            with slots.hold(timeout=0.05):
                pass
        slots.resize(2)  # takes effect at once, also for waiters
        with slots.hold(timeout=0.05) as waited:
            assert waited < 0.05 and slots.active == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="limit must be an int >= 1"):
            ToolSlots(bad)
    assert shared_slots() is shared_slots() and shared_slots().limit == default_limit() >= 1
