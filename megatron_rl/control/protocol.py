"""MPI messages between the controller (rank 0) and the worker ranks.

Every message is a small dataclass pickled by mpi4py; its MPI tag is derived from its type (`Tag`,
one per message class: `tag_of`), so a receiver can wait for one kind and no call site names a
number. Workers never talk to each other over MPI: the trainers share commands and weights over
torch.distributed; everything else goes through the controller (control/mailbox.py sends them).
The weight update's messages are sync/messages.py's (sync/ knows no MPI): they get their tags here.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

from megatron_rl.errors import InputError
from megatron_rl.config import LengthStage
from megatron_rl.records import Batch, GroupRequest, PartialEpisode, Rollout
from megatron_rl.reward.types import RewardBreakdown, ScoreItem
from megatron_rl.sync.messages import (FinishUpdate, GeneratorStatus, Paused, PauseForUpdate, Pushed, PushRequest,
                                       Resumed)

Key = tuple[str, int]  # (group id, sample index)


# ---------------------------------------------------------------- controller <-> generators
@dataclass
class GenerateRequest:
    """Groups for one generator; each is submitted as is (records.GroupRequest: prompt ids once per
    group, its sample indices, length stage and sampling overrides)."""

    groups: list[GroupRequest]


@dataclass
class RolloutsReport:
    rollouts: list[Rollout]
    idle_s: float  # time with nothing in flight since the last report
    busy_s: float
    # turn boundaries episodes in flight reached since the last report (each before its rollout)
    boundaries: list[PartialEpisode] = field(default_factory=list)
    env_waiting: int = 0  # its samples in an environment step now (admission: env.extra_in_flight)


# ---------------------------------------------------------------- controller <-> first trainer
@dataclass
class TrainRequest:
    batch: Batch


@dataclass(frozen=True)
class TrainReport:
    """One trainer update: the policy version it made and its metrics (the means over its optimizer
    steps, and the trainer/generator mismatch; train/trainer.py `train_on`)."""

    version: int
    metrics: dict[str, float]


@dataclass
class Trained:
    report: TrainReport


@dataclass
class SaveRequest:
    root: str
    extra: dict[str, Any]  # saved with the checkpoint (the controller's state)


@dataclass
class Saved:
    path: str


@dataclass
class LoadRequest:
    root: str


@dataclass
class Loaded:
    extra: dict[str, Any]


# ---------------------------------------------------------------- controller <-> verifiers
@dataclass
class GradeItem:
    key: Key
    task: dict[str, Any]
    response: str
    num_tokens: int
    # The length stage the rollout was requested under (Rollout.stage): its overlong-penalty window
    # grades it, even after a stage switch (None: the config's window).
    stage: LengthStage | None = None

    def score_item(self) -> ScoreItem:
        """What the verifier pool grades (reward.types.ScoreItem)."""
        return ScoreItem(self.task, self.response, self.num_tokens, self.stage)


@dataclass
class GradeRequest:
    items: list[GradeItem]


@dataclass
class Graded:
    results: list[tuple[Key, RewardBreakdown]]


# ---------------------------------------------------------------- any
@dataclass
class Stop:
    """Controller -> every worker (trainers: the first, which passes it on): end the rank's loop."""


class Cause(str, Enum):
    """Why a rank failed, which decides what the run says about starting it again."""

    INPUT = "input"  # an InputError: one line; the next start meets the same error
    CRASH = "crash"  # any other exception: a bug or a broken environment; its traceback is kept
    LOST = "lost"  # a rank, server or answer lost or late: starting again (--resume) can help


@dataclass
class WorkerFailure:
    role: str
    rank: int
    error: str  # one line
    trace: str = ""  # the formatted traceback on the failing rank (a crash only)
    fatal: bool = True  # False: a generator whose samples the controller can re-issue elsewhere
    cause: Cause = Cause.CRASH

    @classmethod
    def of(cls, role: str, rank: int, what: str, exc: BaseException, fatal: bool = True) -> "WorkerFailure":
        if isinstance(exc, InputError):  # its message names the file or key to fix: nothing to add
            return cls(role, rank, str(exc), fatal=fatal, cause=Cause.INPUT)
        first_line = next(iter(str(exc).splitlines()), "")  # the rest (a server's log tail) is in the trace
        return cls(role, rank, f"{what}: {type(exc).__name__}: {first_line}",
                   "".join(traceback.format_exception(exc)), fatal)

    def describe(self) -> str:
        return f"{self.role} rank {self.rank} failed: {self.error}"


class Tag(IntEnum):
    GENERATE = 1
    ROLLOUTS = 2
    GEN_STATUS = 3
    PAUSE = 4
    PAUSED = 5
    FINISH = 6
    RESUMED = 7
    TRAIN = 8
    TRAINED = 9
    PUSH = 10
    PUSHED = 11
    SAVE = 12
    SAVED = 13
    LOAD = 14
    LOADED = 15
    GRADE = 16
    GRADED = 17
    STOP = 18
    FAILED = 19


MESSAGE_TYPES: dict[Tag, type] = {
    Tag.GENERATE: GenerateRequest, Tag.ROLLOUTS: RolloutsReport, Tag.GEN_STATUS: GeneratorStatus,
    Tag.PAUSE: PauseForUpdate, Tag.PAUSED: Paused, Tag.FINISH: FinishUpdate, Tag.RESUMED: Resumed,
    Tag.TRAIN: TrainRequest, Tag.TRAINED: Trained, Tag.PUSH: PushRequest, Tag.PUSHED: Pushed,
    Tag.SAVE: SaveRequest, Tag.SAVED: Saved, Tag.LOAD: LoadRequest, Tag.LOADED: Loaded,
    Tag.GRADE: GradeRequest, Tag.GRADED: Graded, Tag.STOP: Stop, Tag.FAILED: WorkerFailure,
}
_TAGS = {cls: tag for tag, cls in MESSAGE_TYPES.items()}
assert len(_TAGS) == len(Tag) == len(MESSAGE_TYPES), "one tag per message class"


def tag_of(message: object) -> Tag:
    return _TAGS[type(message)]


class RunFailed(RuntimeError):
    """The run cannot go on; `failure` names the rank, the error and its cause (the controller's own
    by default, e.g. a timeout: `RunFailed(message, Cause.LOST)`)."""

    def __init__(self, message: str, cause: Cause = Cause.CRASH, failure: WorkerFailure | None = None):
        super().__init__(message)
        self.failure = failure or WorkerFailure("controller", 0, message, cause=cause)

    @classmethod
    def of(cls, failure: WorkerFailure) -> "RunFailed":
        return cls(failure.describe(), failure=failure)
