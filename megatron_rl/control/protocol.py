"""MPI messages between the controller (rank 0) and the worker ranks.

Every message is a small dataclass pickled by mpi4py; the tag says what it is. Workers never talk
to each other over MPI: trainers use torch.distributed among themselves and towards the generators'
weight-update groups; everything else goes through the controller.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from megatron_rl.records import Batch, Rollout


class Tag(IntEnum):
    GENERATE = 1  # ctrl -> gen: GenerateRequest
    ROLLOUTS = 2  # gen -> ctrl: RolloutsReport
    GEN_STATUS = 3  # gen -> ctrl: GeneratorStatus (start-up, after a restart)
    UPDATE_BEGIN = 4  # ctrl -> gen: None (pause + open the weight-update session)
    UPDATE_READY = 5  # gen -> ctrl: GeneratorStatus
    UPDATE_FINISH = 6  # ctrl -> gen: int version
    UPDATE_DONE = 7  # gen -> ctrl: GeneratorStatus
    TRAIN = 8  # ctrl -> trainers: Batch
    TRAINED = 9  # trainer lead -> ctrl: dict metrics
    PUSH = 10  # ctrl -> trainers: PushRequest
    PUSHED = 11  # trainer lead -> ctrl: dict report
    SAVE = 12  # ctrl -> trainers: SaveRequest
    SAVED = 13  # trainer lead -> ctrl: str checkpoint path
    LOAD = 14  # ctrl -> trainers: str checkpoint root
    LOADED = 15  # trainer lead -> ctrl: dict extra state saved with the checkpoint
    GRADE = 16  # ctrl -> verifier: list[GradeItem]
    GRADED = 17  # verifier -> ctrl: list[tuple[key, RewardBreakdown dict]]
    STOP = 18  # ctrl -> all: None
    FAILED = 19  # any -> ctrl: WorkerFailure


@dataclass
class SampleSpec:
    group_id: str
    sample_index: int
    prompt_ids: list[int]


@dataclass
class GenerateRequest:
    samples: list[SampleSpec]
    sampling: dict[str, Any] = field(default_factory=dict)  # overrides, e.g. max_new_tokens


@dataclass
class RolloutsReport:
    rollouts: list[Rollout]
    idle_s: float  # time with nothing in flight since the last report
    busy_s: float


@dataclass
class GeneratorStatus:
    generator_id: int
    url: str
    incarnation: int
    version: int
    needs_weight_sync: bool = False
    reissued: list[SampleSpec] = field(default_factory=list)


@dataclass
class PushRequest:
    version: int
    targets: list[tuple[str, int, int]]  # (url, tp_size, incarnation) of every generator


@dataclass
class SaveRequest:
    root: str
    extra: dict[str, Any]


@dataclass
class GradeItem:
    key: tuple[str, int]  # (group id, sample index)
    task: dict[str, Any]
    response: str
    num_tokens: int
    # Overlong-penalty window of the length stage the rollout was requested under (None: the config's).
    l_max: int | None = None
    l_cache: int | None = None


@dataclass
class WorkerFailure:
    role: str
    rank: int
    error: str
    unfinished: list[SampleSpec] = field(default_factory=list)
    fatal: bool = True


class RunFailed(RuntimeError):
    """A worker failed in a way the run cannot recover from; the message says which and why."""


def batch_summary(batch: Batch) -> dict[str, float]:
    lengths = [s.completion_len for s in batch.sequences]
    return {"batch_sequences": float(len(lengths)), "batch_tokens": float(sum(lengths))}
