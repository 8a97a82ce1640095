"""The asynchronous rollout budget: what is in flight, which groups are complete, what to train on.

Pure bookkeeping (no MPI, no I/O) so every rule is unit-tested:
- keep up to `n_async` sequences in flight (groups of G samples of one problem are issued together;
  up to `env.extra_in_flight` more while episodes wait on their environment, `flight_room`),
  and admit a group only if it can be consumed within the staleness bound (`free_group_slots`,
  AReaL-style admission: the batches already committed ahead of it are counted);
- a group is complete when all G samples are graded; it gets group-centred advantages, or is
  dropped when its rewards are all equal (non-diverse) and its problem is counted as such;
- a sample whose grading failed for good has no reward: its group is dropped whole once complete;
- `take_batch` hands the trainer exactly `n_batch` sequences once that many are ready, after applying
  the staleness bound to what admission could not prevent (a long sample overtaken by shorter ones):
  a group whose token-mean staleness exceeds `max_staleness` is dropped and its problem re-queued
  (stale_policy=drop), or kept for importance re-weighting (reweight);
- everything needed to resume (pending problems, partial groups, ready sequences) is exported by
  `state_dict` so a restart loses and duplicates nothing.
What becomes of a group is a `GroupOutcome`: kept (its samples wait for a batch), or dropped as
non-diverse, for a failed grading, or stale; the counters and the group events name them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import torch

from megatron_rl.algo.advantages import compute_group_advantages
from megatron_rl.config import AlgoConfig, RolloutConfig
from megatron_rl.records import Batch, Problem, Rollout, TrainSequence


class GroupOutcome(StrEnum):
    """What became of a group: the `fate` of its event in groups.jsonl (a StrEnum: written as its value)."""

    KEPT = "kept"  # complete and diverse: its samples wait in `ready` for a batch
    NON_DIVERSE = "non_diverse"  # complete, its rewards all equal (A = 0 everywhere): dropped before batching
    GRADING_FAILED = "grading_failed"  # complete with a sample nobody could grade: dropped whole
    STALE = "stale"  # kept, then dropped by take_batch past max_staleness (stale_policy=drop)


@dataclass
class PendingGroup:
    group_id: str
    problem: Problem
    rollouts: dict[int, Rollout] = field(default_factory=dict)  # graded samples by index
    failed: set[int] = field(default_factory=set)  # samples whose grading failed for good (no reward)

    def has(self, index: int) -> bool:
        """The sample is back: graded, or its grading failed for good."""
        return index in self.rollouts or index in self.failed

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "problem": asdict(self.problem),
                "rollouts": {str(k): r.to_dict() for k, r in self.rollouts.items()}, "failed": sorted(self.failed)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PendingGroup":
        return cls(d["group_id"], Problem(**d["problem"]),
                   {int(k): Rollout.from_dict(r) for k, r in d["rollouts"].items()}, set(d.get("failed", ())))


@dataclass
class ReadySequence:
    """A graded sample of a diverse group, with its group-centred advantage, waiting for a batch."""

    rollout: Rollout
    advantage: float
    group_id: str

    def to_train_sequence(self) -> TrainSequence:
        r = self.rollout
        return TrainSequence(token_ids=list(r.prompt_ids) + list(r.completion_ids), prompt_len=len(r.prompt_ids),
                             behaviour_logprobs=list(r.behaviour_logprobs), advantage=self.advantage,
                             weight_versions=list(r.weight_versions), temperature=r.temperature,
                             group_id=self.group_id, loss_mask=None if r.loss_mask is None else list(r.loss_mask),
                             routed_experts=r.routed_experts)


# the counter of each outcome that drops a group, and its key in the metrics line
DROPPED = {GroupOutcome.NON_DIVERSE: ("groups_dropped_non_diverse", "groups/dropped_non_diverse"),
           GroupOutcome.STALE: ("groups_dropped_stale", "groups/dropped_stale"),
           GroupOutcome.GRADING_FAILED: ("groups_dropped_grading", "groups/dropped_grading")}


@dataclass
class BudgetCounters:
    groups_started: int = 0
    groups_completed: int = 0  # every sample back (graded or given up on): kept, non-diverse or grading failed
    groups_dropped_non_diverse: int = 0
    groups_dropped_stale: int = 0
    groups_dropped_grading: int = 0  # a sample's grading failed for good (budget.add_failed)
    sequences_trained: int = 0
    batches: int = 0
    # lengths of all graded samples and of the trained ones: a staleness rule that drops long samples
    # (the ones that go stale) shows up as trained / completed mean length < 1 (`length_stats`)
    sequences_completed: int = 0
    tokens_completed: int = 0
    tokens_trained: int = 0

    def dropped(self, outcome: GroupOutcome, n: int = 1) -> None:
        name, _ = DROPPED[outcome]
        setattr(self, name, getattr(self, name) + n)

    def group_metrics(self) -> dict[str, int]:
        """`groups/completed` and `groups/dropped_<why>` of the metrics line."""
        return {"groups/completed": self.groups_completed} | {key: getattr(self, name) for name, key in DROPPED.values()}


def token_staleness(rollouts, trainer_version: int) -> float:
    """Mean over the completion tokens of `rollouts` of (trainer_version - the version that sampled the
    token): the staleness the loss sees, token by token (in-flight updates make a sequence partly fresh;
    each token's ratio is taken against its own behaviour logprob). Environment tokens of an episode
    have no version: only the model's count."""
    versions = [r.model_versions for r in rollouts]
    tokens = sum(len(v) for v in versions)
    if not tokens:
        return 0.0
    return trainer_version - sum(sum(v) for v in versions) / tokens


def flight_room(n_async: int, extra: int, in_flight: int, waiting: int) -> int:
    """Samples that may start now: at most `n_async` of those in flight outside an environment step
    (`waiting` of them are in one: a tool run) and at most `n_async + extra` in flight in all
    (env.extra_in_flight). With extra = 0 this is n_async - in_flight."""
    busy = in_flight - min(waiting, in_flight)
    return max(0, min(n_async + extra - in_flight, n_async - busy))


class RolloutBudget:
    def __init__(self, rollout: RolloutConfig, algo: AlgoConfig, extra_in_flight: int = 0):
        self.cfg, self.algo = rollout, algo
        self.extra_in_flight = extra_in_flight  # env.extra_in_flight: episodes admitted while others wait on tools
        self.env_waiting = 0  # samples in an environment step on the generators (their latest reports)
        self.groups: dict[str, PendingGroup] = {}  # issued, not yet complete
        self.ready: deque[ReadySequence] = deque()
        self.requeue: deque[Problem] = deque()  # problems to sample again (stale drops, restarts)
        self.counters = BudgetCounters()
        self._problems: dict[str, Problem] = {}  # problem of every group with ready sequences
        self._group_serial = 0
        self.next_version = 0  # policy version of the next batch taken (trainer version after the last one)
        self.served_version = 0  # weights new samples start with (`weights_served`)

    # ------------------------------------------------------------------ issuing
    @property
    def in_flight(self) -> int:
        """Sequences issued and not yet graded."""
        return sum(self.cfg.group_size - len(g.rollouts) - len(g.failed) for g in self.groups.values())

    @property
    def committed(self) -> int:
        """Samples started and not yet consumed: every sample of an incomplete group, and the ready ones."""
        return self.cfg.group_size * len(self.groups) + len(self.ready)

    @property
    def batches_behind(self) -> int:
        """Batches taken whose weights new samples do not get yet (one while the trainer trains on it or
        pushes it, 0 once the generators serve its result)."""
        return max(0, self.next_version - self.served_version)

    def weights_served(self, version: int) -> None:
        """Every live generator now serves `version`: samples started from now on begin with it."""
        self.served_version = version

    def free_group_slots(self) -> int:
        """How many new groups to start now: within n_async in flight (beyond it by up to extra_in_flight
        while episodes wait on their environment: flight_room), and admitted by the staleness bound.

        Admission (AReaL-style): batches are consumed in order, n_batch samples each, so a sample with c
        committed samples ahead of it goes at the latest into the batch trained at version
        next_version + c // n_batch, and its first token is sampled by served_version. It is started only
        if that lag stays within max_staleness: c + G <= (max_staleness + 1 - batches_behind) * n_batch.
        Only samples overtaken by later-started shorter ones can then exceed the bound (take_batch).
        One exception keeps the run going: while the trainer waits (nothing behind) and fewer than
        n_batch samples are committed, a group is started whatever the bound (G need not divide n_batch)."""
        g, n_batch = self.cfg.group_size, self.cfg.n_batch
        by_flight = flight_room(self.cfg.n_async, self.extra_in_flight, self.in_flight, self.env_waiting) // g
        room = (self.cfg.max_staleness + 1 - self.batches_behind) * n_batch - self.committed
        by_staleness = max(0, room) // g
        if self.batches_behind == 0 and self.committed < n_batch:
            by_staleness = max(by_staleness, 1)
        return max(0, min(by_flight, by_staleness))

    def start_group(self, problem: Problem) -> PendingGroup:
        """A new group of `group_size` samples of `problem` (indices 0 .. G-1), counted in flight."""
        self._group_serial += 1
        group = PendingGroup(f"{problem.problem_id}#{self._group_serial}", problem)
        self.groups[group.group_id] = group
        self.counters.groups_started += 1
        return group

    def outstanding_samples(self) -> list[tuple[str, int]]:
        """(group id, sample index) of every sample issued but not back (what to re-issue on resume)."""
        return [(g.group_id, i) for g in self.groups.values() for i in range(self.cfg.group_size) if not g.has(i)]

    # ------------------------------------------------------------------ results
    def add_graded(self, rollout: Rollout) -> GroupOutcome | None:
        """Record a graded sample of group `rollout.group_id`. Returns the group's outcome once
        complete: KEPT, NON_DIVERSE, GRADING_FAILED (see add_failed); None while samples are missing.
        Duplicates are ignored."""
        group = self.groups.get(rollout.group_id)
        if group is None or group.has(rollout.sample_index):
            return None  # late duplicate of a re-issued sample, or an unknown group
        if rollout.reward is None:
            raise ValueError(f"rollout {rollout.group_id}/{rollout.sample_index} has no reward")
        group.rollouts[rollout.sample_index] = rollout
        self.counters.sequences_completed += 1
        self.counters.tokens_completed += len(rollout.completion_ids)
        if not self._close(group):
            return None
        if group.failed:
            return GroupOutcome.GRADING_FAILED
        samples = [group.rollouts[i] for i in range(self.cfg.group_size)]
        rewards = torch.tensor([[s.reward for s in samples]], dtype=torch.float64)
        adv = compute_group_advantages(rewards, self.algo)
        if adv.n_dropped:
            self.counters.dropped(GroupOutcome.NON_DIVERSE)
            return GroupOutcome.NON_DIVERSE
        self.ready.extend(ReadySequence(s, float(a), group.group_id)
                          for s, a in zip(samples, adv.advantages[0].tolist()))
        self._problems[group.group_id] = group.problem
        return GroupOutcome.KEPT

    def add_failed(self, group_id: str, sample_index: int) -> GroupOutcome | None:
        """Record a sample whose grading failed for good: it has no reward. Once every sample of its group
        is back the whole group is dropped (GRADING_FAILED): a made-up reward would train a verdict no
        grader gave, and centring the others on a group with a member missing would bias their advantages.
        Its problem is not re-queued: one whose grading always fails would be sampled forever."""
        group = self.groups.get(group_id)
        if group is None or group.has(sample_index):
            return None
        group.failed.add(sample_index)
        return GroupOutcome.GRADING_FAILED if self._close(group) else None

    def _close(self, group: PendingGroup) -> bool:
        """Retire a group once all its samples are back (graded or failed); False while some are missing."""
        if len(group.rollouts) + len(group.failed) < self.cfg.group_size:
            return False
        del self.groups[group.group_id]
        self.counters.groups_completed += 1
        if group.failed:
            self.counters.dropped(GroupOutcome.GRADING_FAILED)
        return True

    # ------------------------------------------------------------------ batching
    def take_batch(self, trainer_version: int) -> Batch | None:
        """n_batch ready sequences as a Batch, oldest first; None while fewer are ready.

        Oldest by tokens: the groups whose tokens' mean version is lowest go first (ties: in the order
        they completed), so a group overtaken by later-started shorter ones is trained before it
        crosses the bound rather than dropped; staleness then spreads evenly over the batches."""
        waiting = self._waiting_groups()
        self._drop_stale_groups(trainer_version, waiting)
        if len(self.ready) < self.cfg.n_batch:
            return None
        lag = {gid: token_staleness(rs, trainer_version) for gid, rs in waiting.items()}
        self.ready = deque(sorted(self.ready, key=lambda r: -lag[r.group_id]))  # stable: ties keep their order
        chosen = [self.ready.popleft() for _ in range(self.cfg.n_batch)]
        waiting = {r.group_id for r in self.ready}
        for group_id in {c.group_id for c in chosen} - waiting:
            self._problems.pop(group_id, None)
        self.counters.sequences_trained += len(chosen)
        self.counters.tokens_trained += sum(len(c.rollout.completion_ids) for c in chosen)
        self.counters.batches += 1
        self.next_version = trainer_version + 1
        return Batch([c.to_train_sequence() for c in chosen], n_mini=self.cfg.n_mini,
                     policy_version=trainer_version)

    def _waiting_groups(self) -> dict[str, list[Rollout]]:
        """The ready samples by group (a group split across batches: the samples not trained yet)."""
        waiting: dict[str, list[Rollout]] = {}
        for r in self.ready:
            waiting.setdefault(r.group_id, []).append(r.rollout)
        return waiting

    def _drop_stale_groups(self, trainer_version: int, waiting: dict[str, list[Rollout]]) -> None:
        """stale_policy=drop: remove groups whose token-mean staleness (`token_staleness` over the group's
        waiting samples) exceeds max_staleness. A group none of whose samples was trained yet is re-queued,
        so its problem is sampled again fresh."""
        if self.cfg.stale_policy != "drop":
            return
        stale = {gid for gid, rs in waiting.items() if token_staleness(rs, trainer_version) > self.cfg.max_staleness}
        if not stale:
            return
        self.ready = deque(r for r in self.ready if r.group_id not in stale)
        self.counters.dropped(GroupOutcome.STALE, len(stale))
        for group_id in stale:
            problem = self._problems.pop(group_id)
            if len(waiting[group_id]) == self.cfg.group_size:
                self.requeue.append(problem)

    def length_stats(self) -> dict[str, float]:
        """Mean completion length of the trained samples against all graded ones, since the start: a
        ratio below 1 means the bound (or the filter) keeps short samples rather than long ones."""
        c, out = self.counters, {}
        if c.sequences_completed:
            out["length/completed_mean"] = c.tokens_completed / c.sequences_completed
        if c.sequences_trained and c.tokens_trained:
            out["length/trained_mean"] = c.tokens_trained / c.sequences_trained
        if len(out) == 2:
            out["length/trained_vs_completed"] = out["length/trained_mean"] / out["length/completed_mean"]
        return out

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        return {
            "groups": [g.to_dict() for g in self.groups.values()],
            "ready": [{"rollout": r.rollout.to_dict(), "advantage": r.advantage, "group_id": r.group_id}
                      for r in self.ready],
            "requeue": [asdict(p) for p in self.requeue],
            "problems": {k: asdict(p) for k, p in self._problems.items()},
            "counters": asdict(self.counters),
            "group_serial": self._group_serial,
            "next_version": self.next_version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = {g["group_id"]: PendingGroup.from_dict(g) for g in state["groups"]}
        self.ready = deque(ReadySequence(Rollout.from_dict(r["rollout"]), r["advantage"], r["group_id"])
                           for r in state["ready"])
        self.requeue = deque(Problem(**p) for p in state["requeue"])
        self._problems = {k: Problem(**p) for k, p in state["problems"].items()}
        self.counters = BudgetCounters(**state["counters"])
        self._group_serial = state["group_serial"]
        # a resume pushes the trainer's weights before samples of the next batch are generated
        self.next_version = self.served_version = state.get("next_version", 0)

