"""One versioned weight update across generators and senders (the coordinator's view).

    begin_update on every generator   (pause in_place|retract, open SGLang's update session)
    every sender sends its tensors    (in parallel; pipeline stages each send their own layers)
    check: every sender succeeded, and the union of names covers `expected_names` when given
    finish_update(version) on each    (stamp + verify version, close session, prefix policy, continue)

In one process (tests, benchmarks, a single-rank trainer) `push_weights` runs the senders in threads.
Across trainer ranks the same steps are split: the controller calls `begin_all`, each rank calls
its `WeightSender.send`, the reports are gathered, and the controller calls `finish_all`.

Any failure raises `WeightSyncError` *before* any version is stamped: the generators stay paused with
their session open, so no token is ever sampled from a half-updated model. The caller may retry the
senders (loading is idempotent) and call `finish_all`, or restart the generators.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

import torch

from megatron_rl.rollout.client import PauseMode
from megatron_rl.rollout.generator import Generator
from megatron_rl.sync.sender import SendReport, SyncTarget, WeightSender, WeightSyncError


@dataclass
class SyncReport:
    version: int
    reports: list[SendReport] = field(default_factory=list)
    seconds: float = 0.0
    pause_seconds: float = 0.0  # generation paused for this long

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.reports)


def targets_of(generators: list[Generator]) -> list[SyncTarget]:
    return [SyncTarget(g.server.url, g.server.spec.tp_size, g.incarnation) for g in generators]


def begin_all(generators: list[Generator], mode: PauseMode | None = None) -> None:
    for g in generators:
        g.begin_update(mode)


def check_reports(reports: list[SendReport], expected_names: Iterable[str] | None) -> None:
    seen: dict[str, int] = {}
    for r in reports:
        for n in r.names:
            if n in seen:
                raise WeightSyncError(f"tensor {n} sent by senders {seen[n]} and {r.sender_rank}")
            seen[n] = r.sender_rank
    if expected_names is not None:
        missing = sorted(set(expected_names) - seen.keys())
        if missing:
            raise WeightSyncError(f"partial update: {len(missing)} expected tensors not sent, e.g. {missing[:5]}")


def finish_all(generators: list[Generator], version: int) -> None:
    for g in generators:
        g.finish_update(version)


def push_weights(generators: list[Generator], senders: list[tuple[WeightSender, Iterable[tuple[str, torch.Tensor]]]],
                 version: int, expected_names: Iterable[str] | None = None,
                 mode: PauseMode | None = None) -> SyncReport:
    """Run one complete update in this process; senders run in parallel threads."""
    if not senders:
        raise ValueError("push_weights needs at least one sender")
    t0 = time.perf_counter()
    for s, _ in senders:
        s.retarget(targets_of(generators))
    begin_all(generators, mode)
    try:
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
        check_reports(reports, expected_names)
    except WeightSyncError as e:
        raise WeightSyncError(f"update to version {version} failed; generators stay paused: {e}") from e
    finish_all(generators, version)
    seconds = time.perf_counter() - t0
    return SyncReport(version, reports, seconds, seconds)
