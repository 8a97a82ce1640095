"""The MPI seam: the only module that imports mpi4py.

A `Mailbox` sends typed messages (control/protocol.py; the tag comes from the type) and receives
them in one poll loop: `poll` returns whatever has arrived, as (source rank, message) pairs, waiting
up to `timeout_s` for the first; `await_reply` waits for one message of a given type, holding the
others back for the next `poll` (the rare synchronous waits: a checkpoint, a resume). mpi4py is
imported on first use, so code driven in-process by tests (with a fake communicator that only
records `send`) never initialises MPI.
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

from megatron_rl.control.protocol import MESSAGE_TYPES, Cause, RunFailed, Stop, Tag, WorkerFailure, tag_of

CONTROLLER = 0  # the rank every worker answers
M = TypeVar("M")


def world():
    """MPI.COMM_WORLD (initialises MPI)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


class Mailbox:
    def __init__(self, comm, idle_sleep_s: float = 0.005):
        self.comm = comm
        self.idle_sleep_s = idle_sleep_s  # between probes while nothing arrives
        self._held: list[tuple[int, object]] = []  # arrived during an await_reply

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    def send(self, dest: int, message: object) -> None:
        self.comm.send(message, dest=dest, tag=int(tag_of(message)))

    def send_all(self, ranks: list[int], message: object) -> None:
        for r in ranks:
            self.send(r, message)

    def fail(self, failure: WorkerFailure) -> None:
        """Tell the controller this rank failed (with its traceback)."""
        self.send(CONTROLLER, failure)

    def poll(self, timeout_s: float = 0.0, source: int | None = None) -> list[tuple[int, object]]:
        """Every message waiting (held ones first); if none, wait up to `timeout_s` for one."""
        out, self._held = self._held, []
        deadline = time.monotonic() + timeout_s
        while True:
            while (got := self._receive(source)) is not None:
                out.append(got)
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(self.idle_sleep_s)

    def await_reply(self, kind: type[M], timeout_s: float, source: int | None = None,
                    on_failure: Callable[[int, WorkerFailure], None] | None = None) -> M:
        """The next message of type `kind`; other messages wait for the next `poll`, except failures,
        which go to `on_failure` at once (it may raise). RunFailed after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            while (got := self._receive(source)) is not None:
                rank, message = got
                if isinstance(message, kind):
                    return message
                if isinstance(message, WorkerFailure) and on_failure is not None:
                    on_failure(rank, message)
                else:
                    self._held.append(got)
            if time.monotonic() >= deadline:
                raise RunFailed(f"no {kind.__name__} message within {timeout_s:.0f} s", Cause.LOST)
            time.sleep(self.idle_sleep_s)

    def wait_for_stop(self) -> None:
        """After a failure: drop everything until the controller says Stop."""
        while True:
            for _, message in self.poll(timeout_s=1.0, source=CONTROLLER):
                if isinstance(message, Stop):
                    return

    def _receive(self, source: int | None) -> tuple[int, object] | None:
        from mpi4py import MPI

        status = MPI.Status()
        if not self.comm.Iprobe(source=MPI.ANY_SOURCE if source is None else source, tag=MPI.ANY_TAG,
                                status=status):
            return None
        rank, tag = status.Get_source(), Tag(status.Get_tag())
        message = self.comm.recv(source=rank, tag=tag)
        if not isinstance(message, MESSAGE_TYPES[tag]):
            raise RunFailed(f"rank {rank} sent a {type(message).__name__} tagged {tag.name}")
        return rank, message
