"""One versioned, all-or-nothing weight update trainer -> generators, and its coordinator.

    PAUSING    every generator pauses (in_place | retract) and opens SGLang's weight-update session;
               it answers with its `SyncTarget` (url, TP size, server incarnation)
    PUSHING    every sending trainer rank streams its pipeline stage's tensors to every target
               (`trainer_push.TrainerPush`, `sender.WeightSender`); `check_complete` then proves
               the union of what was sent covers the model
    FINISHING  every generator stamps the version, verifies it, closes the session and continues
    IDLE

`UpdateCycle` is the coordinator's state (the phase, and which generators it still waits on); it
does no I/O. The controller drives it with messages (control/controller.py); `push_in_process`
drives the same cycle in one process (tests, benchmarks: Generator objects and WeightSenders).

A failure before FINISHING stamps no version: the generators stay paused with their session open,
so no token is sampled from a half-updated model (loading is idempotent: the senders may retry).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Hashable, Iterable, TypeVar

import torch

from megatron_rl.rollout.client import PauseMode
from megatron_rl.rollout.generator import Generator
from megatron_rl.sync.sender import SendReport, SyncTarget, WeightSender, WeightSyncError

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


def target_of(gen: Generator) -> SyncTarget:
    """Where senders reach a generator: its update group is 1 sender + the server's tp_size ranks."""
    return SyncTarget(gen.server.url, gen.server.spec.tp_size, gen.incarnation)


def check_complete(sent_names: Iterable[str], expected_names: Iterable[str] | None) -> None:
    """A push that left out a tensor any sender was meant to send is partial: WeightSyncError."""
    if expected_names is None:
        return
    missing = sorted(set(expected_names) - set(sent_names))
    if missing:
        raise WeightSyncError(f"partial update: {len(missing)} expected tensors not sent, e.g. {missing[:5]}")


@dataclass
class SyncReport:
    version: int
    reports: list[SendReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.reports)


def push_in_process(generators: list[Generator],
                    senders: list[tuple[WeightSender, Iterable[tuple[str, torch.Tensor]]]], version: int,
                    expected_names: Iterable[str] | None = None, mode: PauseMode | None = None) -> SyncReport:
    """One whole update in this process (the controller's cycle with the generators and senders at
    hand); the senders run in parallel threads."""
    if not senders:
        raise ValueError("an update needs at least one sender")
    t0 = time.perf_counter()
    cycle: UpdateCycle[int] = UpdateCycle()
    for i in cycle.begin(version, range(len(generators))):
        generators[i].begin_update(mode)
        cycle.ack(i, target_of(generators[i]))
    cycle.advance()
    try:
        for s, _ in senders:
            s.retarget(cycle.push_targets())
        with ThreadPoolExecutor(max_workers=len(senders)) as pool:
            futures = [pool.submit(s.send, tensors) for s, tensors in senders]
            errors, reports = [], []
            for f in futures:
                try:
                    reports.append(f.result())
                except Exception as e:
                    errors.append(e)
        if errors:
            raise WeightSyncError(f"{len(errors)} of {len(senders)} senders failed: {errors[0]}") from errors[0]
        check_complete((n for r in reports for n in r.names), expected_names)
    except WeightSyncError as e:
        raise WeightSyncError(f"update to version {version} failed; generators stay paused: {e}") from e
    cycle.advance()
    for i in sorted(cycle.waiting):
        generators[i].finish_update(version)
        cycle.ack(i)
    cycle.advance()
    return SyncReport(version, reports, time.perf_counter() - t0)
