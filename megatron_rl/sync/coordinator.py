"""The one coordinator of weight updates: a versioned, all-or-nothing update trainers -> generators.

    PAUSING    every generator pauses (in_place | retract) and opens SGLang's weight-update session;
               it answers with its `SyncTarget` (url, TP size, server incarnation)
    PUSHING    every sending trainer rank streams its pipeline stage's tensors to every target
               (`trainer_push.TrainerPush`, `sender.WeightSender`); `check_complete` then proves
               the union of what was sent covers the model
    FINISHING  every generator stamps the version, verifies it, closes the session and continues
    IDLE

`UpdateCycle` is the state of one update (the phase, and which generators it still waits on); it
does no I/O. `WeightUpdate` drives it with the messages of messages.py over a `Transport` (the
controller's mailbox), and knows which generators lack the trainers' weights (a server restarted
with its disk weights, a resume): `push_needed`. `update.push_in_process` drives the same cycle in
one process (tests, benchmarks). The generator side is generator_side.py, the trainer side
trainer_push.py.

A failure before FINISHING stamps no version: the generators stay paused with their session open,
so no token is sampled from a half-updated model (loading is idempotent: the senders may retry).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Generic, Hashable, Iterable, Protocol, TypeVar

from megatron_rl.sync.messages import (FinishUpdate, GeneratorStatus, Paused, PauseForUpdate, PushReport, Pushed,
                                       PushRequest, Resumed)
from megatron_rl.sync.sender import SyncTarget, WeightSyncError

K = TypeVar("K", bound=Hashable)  # how the coordinator names a generator (an MPI rank, an index)


class Phase(Enum):
    IDLE = "idle"
    PAUSING = "pausing"  # waiting for every generator to pause
    PUSHING = "pushing"  # waiting for the senders
    FINISHING = "finishing"  # waiting for every generator to stamp the version


_NEXT = {Phase.PAUSING: Phase.PUSHING, Phase.PUSHING: Phase.FINISHING, Phase.FINISHING: Phase.IDLE}


class UpdateCycle(Generic[K]):
    """pause -> push -> finish for one version. `begin`, then `ack` each generator's answer (and
    `drop` a dead one); when `ack`/`drop` return True the phase's wait is over: `advance`."""

    def __init__(self):
        self.phase = Phase.IDLE
        self.version = -1
        self.waiting: set[K] = set()
        self.targets: dict[K, SyncTarget] = {}  # of the paused generators

    def begin(self, version: int, generators: Iterable[K]) -> list[K]:
        """Start an update to `version`; returns the generators to pause."""
        if self.phase is not Phase.IDLE:
            raise WeightSyncError(f"update to version {version} begun during the {self.phase.value} phase")
        self.phase, self.version = Phase.PAUSING, version
        self.waiting, self.targets = set(generators), {}
        if not self.waiting:
            raise WeightSyncError("no generator to update")
        return sorted(self.waiting)

    def ack(self, gen: K, target: SyncTarget | None = None) -> bool:
        """`gen` paused (with its target) or finished; True when nobody else is awaited."""
        if self.phase not in (Phase.PAUSING, Phase.FINISHING) or gen not in self.waiting:
            raise WeightSyncError(f"unexpected answer from generator {gen} in the {self.phase.value} phase")
        self.waiting.discard(gen)
        if self.phase is Phase.PAUSING:
            if target is None:
                raise WeightSyncError(f"generator {gen} paused without telling where to push")
            self.targets[gen] = target
        return not self.waiting

    def drop(self, gen: K) -> bool:
        """`gen` died: wait for it no longer; True when that ends the wait of a pause or finish."""
        awaited = gen in self.waiting
        self.waiting.discard(gen)
        self.targets.pop(gen, None)
        return awaited and not self.waiting and self.phase in (Phase.PAUSING, Phase.FINISHING)

    def advance(self) -> Phase:
        """Next phase: PUSHING (all paused), FINISHING (all pushed: await every paused generator), IDLE."""
        if self.phase is Phase.IDLE or (self.waiting and self.phase is not Phase.PUSHING):
            raise WeightSyncError(f"cannot leave the {self.phase.value} phase yet (waiting on {sorted(self.waiting)})")
        self.phase = _NEXT[self.phase]
        if self.phase is Phase.FINISHING:
            self.waiting = set(self.targets)
        return self.phase

    def push_targets(self) -> list[SyncTarget]:
        return [self.targets[g] for g in sorted(self.targets)]


class Transport(Protocol):
    """How the coordinator reaches the generators and the first trainer (control/mailbox.Mailbox)."""

    def send(self, dest: int, message: object) -> None: ...

    def send_all(self, ranks: list[int], message: object) -> None: ...


@dataclass(frozen=True)
class UpdateDone:
    """An update's cycle ended: every live generator that paused stamped `version` and continues."""

    version: int
    push: PushReport
    push_wall_s: float  # PushRequest sent -> Pushed received
    served: bool  # every live generator serves `version` (else one restarted meanwhile: `push_needed`)


class WeightUpdate:
    """The coordinator: `begin(version)`, then hand it every update message (`on_status`, `on_step`)
    and every dead generator (`drop`); `on_step`/`drop` return an `UpdateDone` when the cycle ends.

    `trainer`: the rank that takes PushRequest (it shares it with the other trainers);
    `generators`: the live generator ranks, asked at each update and at its end."""

    def __init__(self, transport: Transport, trainer: int, generators: Callable[[], list[int]]):
        self.transport, self.trainer, self.generators = transport, trainer, generators
        self.cycle: UpdateCycle[int] = UpdateCycle()  # over generator ranks
        self.push_needed = False  # a generator serves other weights than the trainers' (restart, resume)
        self.status: dict[int, GeneratorStatus] = {}  # each generator's last report
        self._push: PushReport | None = None
        self._push_started = 0.0
        self._push_wall_s = 0.0

    @property
    def idle(self) -> bool:
        return self.cycle.phase is Phase.IDLE

    def begin(self, version: int) -> None:
        """Pause every live generator for an update to `version` (the trainers' weights)."""
        self.push_needed = False
        self.transport.send_all(self.cycle.begin(version, self.generators()), PauseForUpdate())

    def on_status(self, rank: int, status: GeneratorStatus, version: int) -> None:
        """A generator started or its server restarted: a push is needed when it lacks `version`,
        the trainers' weights (a restart serves disk weights)."""
        restarted = rank in self.status and status.target.incarnation != self.status[rank].target.incarnation
        self.status[rank] = status
        self.push_needed |= restarted or status.version != version

    def on_step(self, rank: int, message: Paused | Resumed | Pushed) -> UpdateDone | None:
        """A generator paused or resumed, or the trainers pushed."""
        if isinstance(message, Pushed):
            self._push = message.report
            self._push_wall_s = time.time() - self._push_started
            return self._next_phase()
        self.status[rank] = message.status
        return self._next_phase() if self.cycle.ack(rank, message.status.target) else None

    def drop(self, rank: int) -> UpdateDone | None:
        """Generator `rank` died: the update awaits it no longer."""
        return self._next_phase() if self.cycle.drop(rank) else None

    def _next_phase(self) -> UpdateDone | None:
        phase = self.cycle.advance()
        if phase is Phase.PUSHING:  # every generator paused with an open update session
            self._push_started = time.time()
            self.transport.send(self.trainer, PushRequest(self.cycle.version, self.cycle.push_targets()))
        elif phase is Phase.FINISHING:
            self.transport.send_all(sorted(self.cycle.waiting), FinishUpdate(self.cycle.version))
            if not self.cycle.waiting:
                return self._next_phase()
        else:  # IDLE: every generator stamped the new version and continues
            # A generator restarted during the update serves its disk weights: push again.
            version = self.cycle.version
            self.push_needed = any(self.status[r].version != version for r in self.generators())
            assert self._push is not None, "an update ends after its push"
            return UpdateDone(version, self._push, self._push_wall_s, served=not self.push_needed)
        return None
