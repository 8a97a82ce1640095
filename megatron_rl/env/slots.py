"""A cap on concurrent tool runs in one process, so tools never starve generation of CPUs.

A generator rank runs many episodes at once in threads; each may want to run a tool (a sandboxed
Python process) at the same moment. :class:`ToolSlots` lets at most ``limit`` of them run at a time;
the others wait (their wait is reported, ``tool_wait_s``). The environments of one process share
:func:`shared_slots` unless they are given their own (the ``slots`` constructor parameter of
:class:`megatron_rl.env.python_tool.PythonTool`). Its default limit is half the CPUs this process
may use (at least 1); ``shared_slots().resize(n)`` changes it for the whole process, also while
tools run (runs already started finish; new ones start when fewer than ``n`` run).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator


def default_limit() -> int:
    """Half the CPUs this process may run on, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(1, cpus // 2)


class ToolSlots:
    """At most ``limit`` holders at once (a resizable semaphore with counters for metrics)."""

    def __init__(self, limit: int | None = None):
        self._cond = threading.Condition()
        self._limit = 0
        self.active = 0  # runs holding a slot now
        self.peak = 0  # most runs that held a slot at once
        self.waiting = 0  # runs waiting for a slot now
        self.resize(default_limit() if limit is None else limit)

    @property
    def limit(self) -> int:
        return self._limit

    def resize(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"ToolSlots: limit must be an int >= 1, got {limit!r}")
        with self._cond:
            self._limit = limit
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self, timeout: float | None = None) -> Iterator[float]:
        """Hold a slot for the block; yields the seconds waited for it. TimeoutError past ``timeout``."""
        t0 = time.perf_counter()
        with self._cond:
            self.waiting += 1
            try:
                if not self._cond.wait_for(lambda: self.active < self._limit, timeout):
                    raise TimeoutError(f"no tool slot free within {timeout} s ({self.active} of "
                                       f"{self._limit} in use)")
            finally:
                self.waiting -= 1
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            yield time.perf_counter() - t0
        finally:
            with self._cond:
                self.active -= 1
                self._cond.notify()


_shared: ToolSlots | None = None
_shared_lock = threading.Lock()


def shared_slots() -> ToolSlots:
    """The slots shared by the environments of this process (made on first use, default limit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ToolSlots()
        return _shared
