"""One whole weight update in one process: `push_in_process` drives the coordinator's `UpdateCycle`
(coordinator.py) with `Generator` objects and `WeightSender`s at hand (tests, benchmarks), where a
run drives it with messages (coordinator.WeightUpdate). Also the two helpers both paths share:
`target_of` (where senders reach a generator) and `check_complete` (a push that left out a tensor
is partial).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

import torch

from megatron_rl.rollout.client import PauseMode
from megatron_rl.rollout.generator import Generator
from megatron_rl.sync.coordinator import UpdateCycle
from megatron_rl.sync.sender import SendReport, SyncTarget, WeightSender, WeightSyncError


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
