"""Small typed records that cross subsystem boundaries (generators -> controller -> trainer).

control/ talks to rollout/, reward/ and train/ only through these: no subsystem reaches into
another's internals. They are plain dataclasses of Python scalars and lists, so they pickle cheaply
over MPI and serialise to JSON for checkpoints of the controller state.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Problem:
    """One task: the prompt text plus what its verifier needs (`task` is passed to reward.score)."""

    problem_id: str
    prompt: str  # user-visible problem statement
    task: dict[str, Any]  # e.g. {"kind": "math", "answer": "42"} or {"kind": "code", "tests": [...]}
    language: str | None = None  # ISO code of the problem's language when known
    # The prompt as chat messages ({role, content}) when the data gave it so; `prompt` is then the last
    # user message. None: the prompt is the one user message (plus the configured system prompt).
    messages: list[dict[str, str]] | None = None


@dataclass
class SampleRequest:
    """One completion to generate: sample `sample_index` of group `group_id`, from `prompt_ids`.
    What the controller issues, a generator runs (and re-issues after a server restart)."""

    group_id: str
    sample_index: int
    prompt_ids: list[int]

    @property
    def key(self) -> tuple[str, int]:
        return self.group_id, self.sample_index


@dataclass
class Rollout:
    """One sampled completion with everything the loss needs, token by token."""

    group_id: str  # the G samples of one prompt share it (the controller: "<problem id>#<serial>")
    sample_index: int  # index within the group of G samples
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # logprob the generator reported for each completion token
    weight_versions: list[int]  # policy version that produced each completion token
    finish_reason: FinishReason
    text: str = ""  # decoded completion
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    generator_id: int = 0
    # Length stage the sample was requested under (rollout.length_schedule): its generation cap and
    # the overlong-penalty window it is graded with, even when grading happens after a stage switch.
    max_new_tokens: int | None = None
    l_max: int | None = None
    l_cache: int | None = None
    # Sampling temperature: the behaviour logprobs are of log_softmax(logits / temperature).
    temperature: float = 1.0

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.behaviour_logprobs) != n or len(self.weight_versions) != n:
            raise ValueError(
                f"rollout {self.group_id}/{self.sample_index}: {n} completion tokens but "
                f"{len(self.behaviour_logprobs)} logprobs and {len(self.weight_versions)} versions")

    @property
    def key(self) -> tuple[str, int]:
        return self.group_id, self.sample_index

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else -1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Rollout":
        if "problem_id" in data:  # checkpoints written before the field was named for what it holds
            data = {("group_id" if k == "problem_id" else k): v for k, v in data.items()}
        return cls(**data)


@dataclass
class TrainSequence:
    """One sequence as the trainer sees it: prompt + completion tokens, loss on the completion."""

    token_ids: list[int]  # prompt followed by completion
    prompt_len: int
    behaviour_logprobs: list[float]  # one per completion token (len(token_ids) - prompt_len)
    advantage: float  # group-centred advantage (minibatch normalisation happens in the trainer)
    weight_versions: list[int] = field(default_factory=list)
    # Temperature the completion was sampled at: the trainer scores it with logits / temperature.
    temperature: float = 1.0
    group_id: str = ""  # samples of one prompt share it (the KL-in-reward baseline is per group)

    def __post_init__(self) -> None:
        n = len(self.token_ids) - self.prompt_len
        if self.prompt_len < 1 or n < 1:
            raise ValueError(f"sequence needs >= 1 prompt and >= 1 completion token (prompt_len={self.prompt_len}, "
                             f"total={len(self.token_ids)})")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy samples cannot be trained on), got {self.temperature}")
        if len(self.behaviour_logprobs) != n:
            raise ValueError(f"{n} completion tokens but {len(self.behaviour_logprobs)} behaviour logprobs")
        if self.weight_versions and len(self.weight_versions) != n:  # empty: versions unknown
            raise ValueError(f"{n} completion tokens but {len(self.weight_versions)} weight versions")

    @property
    def completion_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class Batch:
    """n_batch sequences for one trainer update, split by the trainer into n_mini minibatches."""

    sequences: list[TrainSequence]
    n_mini: int
    policy_version: int  # trainer version these rollouts are trained from (before the update)

    def __post_init__(self) -> None:
        if self.n_mini < 1 or len(self.sequences) % self.n_mini:
            raise ValueError(f"{len(self.sequences)} sequences cannot be split into {self.n_mini} minibatches")
