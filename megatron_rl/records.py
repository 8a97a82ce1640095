"""Small typed records that cross subsystem boundaries (controller -> generators -> controller -> trainer).

control/ talks to rollout/, reward/ and train/ only through these: no subsystem reaches into
another's internals. They are plain dataclasses of Python scalars and lists (and the config's frozen
`LengthStage`), so they pickle cheaply over MPI and serialise to JSON for checkpoints of the
controller state.

The rollout path, typed end to end:
    GroupRequest   the controller asks a generator for samples of one group: the prompt's token ids
                   once, the sample indices, the length stage in force and sampling overrides (and
                   the episodes to continue rather than start: `resume`)
    PartialEpisode a generator reports each in-flight episode at every turn boundary; the controller
                   keeps the latest in its checkpoints, and a resume continues the episode from it
    Rollout        each sample comes back with the stage it was requested under (`Rollout.stage`): its
                   cap, and the overlong-penalty window it is graded with even after a stage switch
    TrainSequence  a graded sample of a kept group, with its advantage, as the trainer takes it

Episodes (multi-turn; the design's "Episodes"): a rollout is an episode of one or more model turns
with environment tokens (tool output, user turns) between them. Its completion is everything after
the prompt, in order: model-sampled tokens and environment tokens, each encoded once. `loss_mask`
(one entry per completion token) tells them apart: 1 = sampled by the model (its behaviour logprob
and weight version are real, it carries loss), 0 = environment (no loss; its `behaviour_logprobs`
entry is ENV_LOGPROB and its `weight_versions` entry ENV_VERSION, placeholders nothing reads).
`loss_mask` None (a single-turn sample, a one-turn episode) means every completion token is
model-sampled. `TrainSequence` carries the same mask, so the trainer's loss mask honours it;
staleness and version statistics read `model_versions` (the model tokens' versions only).

MoE routing replay (`algo.routing_replay`; docs/train.md "Routing replay"): a Rollout and its
TrainSequence may carry `RoutedExperts`, the experts the generator's router chose at every position it
ran through the model, packed as bytes (a list of ints would take ~28 bytes per id).
"""
from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from megatron_rl.config import LengthStage

FinishReason = Literal["stop", "length", "abort"]
ENV_LOGPROB = 0.0  # behaviour logprob placeholder of an environment token (loss_mask 0)
ENV_VERSION = -1  # weight version placeholder of an environment token (loss_mask 0)


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


def check_loss_mask(mask: list[int] | None, n: int, what: str) -> None:
    """A loss mask over `n` completion tokens: None, or n entries each 0 (environment) or 1 (model)."""
    if mask is None:
        return
    if len(mask) != n:
        raise ValueError(f"{what}: {n} completion tokens but a loss mask of {len(mask)}")
    if any(m not in (0, 1) or isinstance(m, float) for m in mask):
        raise ValueError(f"{what}: loss mask entries must be 0 (environment) or 1 (model), got {sorted(set(mask))}")


@dataclass(frozen=True)
class RoutedExperts:
    """The experts the generator's MoE router chose for one sequence: `ids` holds an array
    [positions, layers, topk] of expert ids, row-major, `itemsize` bytes each (1: uint8, models with at
    most 256 experts; 2: uint16, little-endian). Position p is token p of prompt + completion as it went
    through the model; the positions are all but the last token (the generator never runs its last
    sampled token, and that token's routing changes no logprob)."""

    ids: bytes
    layers: int
    topk: int
    itemsize: int = 1

    def __post_init__(self) -> None:
        if self.itemsize not in (1, 2) or self.layers < 1 or self.topk < 1:
            raise ValueError(f"routed experts: itemsize {self.itemsize} (1 or 2), layers {self.layers} and "
                             f"topk {self.topk} (>= 1)")
        if len(self.ids) % self.bytes_per_position:
            raise ValueError(f"routed experts: {len(self.ids)} bytes are no whole number of positions of "
                             f"{self.bytes_per_position} bytes")

    @property
    def bytes_per_position(self) -> int:
        return self.layers * self.topk * self.itemsize

    @property
    def positions(self) -> int:
        return len(self.ids) // self.bytes_per_position

    def check_covers(self, n_tokens: int, what: str) -> None:
        """ValueError unless these are the routes of a sequence of `n_tokens` tokens (all but its last)."""
        if self.positions != n_tokens - 1:
            raise ValueError(f"{what}: {n_tokens} tokens but routed experts of {self.positions} positions "
                             f"(expected {n_tokens - 1}: every token but the last)")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (controller checkpoints): the ids as base64."""
        return {**asdict(self), "ids": base64.b64encode(self.ids).decode("ascii")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RoutedExperts":
        return cls(**(dict(data) | {"ids": base64.b64decode(data["ids"])}))


@dataclass
class GroupRequest:
    """Samples of one group to generate, as the controller issues them and a generator runs them as is
    (its requests share the prompt's prefix cache): all G indices at first, the missing ones when
    samples are issued again (a generator lost, a resume).

    `stage`: the length stage in force at issue: the samples are capped at its `max_new_tokens` and
    their rollouts carry it back (`Rollout.stage`) to be graded with its overlong-penalty window. None
    (offline sampling, e.g. `megatron-rl evaluate`): the generator's own cap, and no stage on the rollouts.
    `sampling`: overrides of the rollout's sampling parameters on top of the stage's cap (the
    evaluation's temperature)."""

    group_id: str
    prompt_ids: list[int]
    sample_indices: list[int]
    stage: LengthStage | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    task: dict[str, Any] = field(default_factory=dict)  # the problem's task: each episode's environment starts on it
    # episodes to continue from their last turn boundary instead of starting them (a resume, a lost
    # generator): by sample index, each one of `sample_indices`
    resume: dict[int, "PartialEpisode"] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.sample_indices or len(set(self.sample_indices)) != len(self.sample_indices):
            raise ValueError(f"group {self.group_id}: sample indices must be distinct and at least one, "
                             f"got {self.sample_indices}")
        if not set(self.resume) <= set(self.sample_indices):
            raise ValueError(f"group {self.group_id}: episodes to resume {sorted(self.resume)} are not all among "
                             f"its sample indices {self.sample_indices}")

    @property
    def keys(self) -> list[tuple[str, int]]:
        return [(self.group_id, i) for i in self.sample_indices]

    def sampling_overrides(self) -> dict[str, Any]:
        """What the generator lays over its configured sampling: the stage's cap, then `sampling`."""
        cap = {} if self.stage is None else {"max_new_tokens": self.stage.max_new_tokens}
        return cap | self.sampling


EpisodeStop = Literal["done", "max_turns", "max_tokens", "deadline", "abort", "env_error"]


@dataclass
class EpisodeReport:
    """How an episode went (megatron_rl.rollout.episode): its turns, why it ended, what its tools did,
    and the environment's own verdict when it gave one. A single-turn sample is a one-turn episode."""

    turns: int = 1  # model turns sampled
    stop: EpisodeStop = "done"  # done: the environment ended it; max_turns / max_tokens / deadline: a cap did
    env_tokens: int = 0  # environment tokens in the completion (loss_mask 0)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_s: float = 0.0  # wall time of the environment's steps
    prompt_tokens: int = 0  # input tokens of every turn's request, summed
    cached_tokens: int = 0  # of those, served from the prefix cache
    # The environment's own reward (None: the final turn is graded by the verifiers) and its verdict.
    reward: float | None = None
    correct: bool | None = None
    error: str | None = None  # the environment failed (one line): the episode is never trained
    # turns restored from a checkpoint (PartialEpisode) rather than sampled by this run; 0: none
    resumed_turns: int = 0
    # a resume found the environment did not replay the recorded turns: the episode started over
    replay_diverged: bool = False


@dataclass
class PartialEpisode:
    """An episode in flight, up to its last completed turn boundary: the context as the model saw it
    (the prompt with the environment's first messages, then model and environment tokens with their
    logprobs, versions and mask, exactly as a finished Rollout carries them), and what it takes to bring
    a new environment to the same point (`turns`: each model turn's text, replayed through `step`;
    `observations`: the messages the environment answered, which the replay must reproduce).
    `report` is the episode's report so far; `elapsed_s` the wall time it has run (its deadline counts it)."""

    group_id: str
    sample_index: int
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    mask: list[int]
    turns: list[str]
    observations: list[list[dict[str, str]]]
    report: EpisodeReport
    elapsed_s: float = 0.0

    def __post_init__(self) -> None:
        n, where = len(self.ids), f"partial episode {self.group_id}/{self.sample_index}"
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(f"{where}: {n} tokens but {len(self.logprobs)} logprobs and {len(self.versions)} versions")
        check_loss_mask(self.mask, n, where)
        if len(self.turns) != len(self.observations) or not self.turns:
            raise ValueError(f"{where}: {len(self.turns)} turns but {len(self.observations)} observations")

    @property
    def key(self) -> tuple[str, int]:
        return self.group_id, self.sample_index

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PartialEpisode":
        return cls(**(dict(data) | {"report": EpisodeReport(**data["report"])}))


@dataclass
class Rollout:
    """One sampled completion (an episode) with everything the loss needs, token by token."""

    group_id: str  # the G samples of one prompt share it (the controller: "<problem id>#<serial>")
    sample_index: int  # index within the group of G samples
    prompt_ids: list[int]
    completion_ids: list[int]  # model turns and, in an episode, environment tokens between them
    behaviour_logprobs: list[float]  # logprob the generator reported for each completion token
    weight_versions: list[int]  # policy version that produced each completion token
    finish_reason: FinishReason
    text: str = ""  # decoded completion: of an episode, its final model turn (what is graded)
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)  # RewardBreakdown.components()
    generator_id: int = 0
    # Length stage the sample was requested under (GroupRequest.stage): its generation cap and the
    # overlong-penalty window it is graded with, even when grading happens after a stage switch.
    stage: LengthStage | None = None
    # Sampling temperature: the behaviour logprobs are of log_softmax(logits / temperature).
    temperature: float = 1.0
    # 1 = model-sampled, 0 = environment token (module docstring); None: every token is the model's.
    loss_mask: list[int] | None = None
    episode: EpisodeReport = field(default_factory=EpisodeReport)
    # The generator's expert choices (routing replay); None: not asked for, or the server returned none.
    routed_experts: RoutedExperts | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.behaviour_logprobs) != n or len(self.weight_versions) != n:
            raise ValueError(
                f"rollout {self.group_id}/{self.sample_index}: {n} completion tokens but "
                f"{len(self.behaviour_logprobs)} logprobs and {len(self.weight_versions)} versions")
        check_loss_mask(self.loss_mask, n, f"rollout {self.group_id}/{self.sample_index}")
        if self.routed_experts is not None:
            self.routed_experts.check_covers(len(self.prompt_ids) + n, f"rollout {self.group_id}/{self.sample_index}")

    @property
    def key(self) -> tuple[str, int]:
        return self.group_id, self.sample_index

    @property
    def model_versions(self) -> list[int]:
        """Weight versions of the model-sampled tokens (environment tokens have none)."""
        if self.loss_mask is None:
            return self.weight_versions
        return [v for v, m in zip(self.weight_versions, self.loss_mask) if m]

    @property
    def oldest_version(self) -> int:
        versions = self.model_versions
        return min(versions) if versions else -1

    def to_dict(self) -> dict[str, Any]:
        routed = self.routed_experts
        return asdict(self) | {"routed_experts": None if routed is None else routed.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Rollout":
        data = dict(data)
        if "problem_id" in data:  # checkpoints written before the field was named for what it holds
            data["group_id"] = data.pop("problem_id")
        old = [data.pop(k, None) for k in ("max_new_tokens", "l_max", "l_cache")]  # before `stage`
        if isinstance(data.get("stage"), dict):
            data["stage"] = LengthStage(**data["stage"])
        elif None not in old:  # the stage's start was not kept then: only its cap and window matter
            data["stage"] = LengthStage(0, *old)
        if isinstance(data.get("episode"), dict):
            data["episode"] = EpisodeReport(**data["episode"])
        if isinstance(data.get("routed_experts"), dict):
            data["routed_experts"] = RoutedExperts.from_dict(data["routed_experts"])
        return cls(**data)


@dataclass
class TrainSequence:
    """One sequence as the trainer sees it: prompt + completion tokens, loss on the completion's model
    tokens (all of them, or those `loss_mask` marks 1: environment tokens of an episode carry none)."""

    token_ids: list[int]  # prompt followed by completion
    prompt_len: int
    behaviour_logprobs: list[float]  # one per completion token (len(token_ids) - prompt_len)
    advantage: float  # group-centred advantage (minibatch normalisation happens in the trainer)
    weight_versions: list[int] = field(default_factory=list)
    # Temperature the completion was sampled at: the trainer scores it with logits / temperature.
    temperature: float = 1.0
    group_id: str = ""  # samples of one prompt share it (the KL-in-reward baseline is per group)
    loss_mask: list[int] | None = None  # Rollout.loss_mask: one per completion token; None: all 1
    routed_experts: RoutedExperts | None = None  # Rollout.routed_experts (None: the trainer routes it all)

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
        check_loss_mask(self.loss_mask, n, "sequence")
        if self.loss_mask is not None and not any(self.loss_mask):
            raise ValueError("sequence has no model-sampled completion token (its loss mask is all 0)")
        if self.routed_experts is not None:
            self.routed_experts.check_covers(len(self.token_ids), "sequence")

    @property
    def completion_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def n_loss_tokens(self) -> int:
        """Completion tokens that carry loss: all of them, or the model's of an episode."""
        return self.completion_len if self.loss_mask is None else sum(self.loss_mask)

    @property
    def model_versions(self) -> list[int]:
        """Weight versions of the tokens that carry loss (empty: versions unknown)."""
        if self.loss_mask is None or not self.weight_versions:
            return self.weight_versions
        return [v for v, m in zip(self.weight_versions, self.loss_mask) if m]


@dataclass
class Batch:
    """n_batch sequences for one trainer update, split by the trainer into n_mini minibatches."""

    sequences: list[TrainSequence]
    n_mini: int
    policy_version: int  # trainer version these rollouts are trained from (before the update)

    def __post_init__(self) -> None:
        if self.n_mini < 1 or len(self.sequences) % self.n_mini:
            raise ValueError(f"{len(self.sequences)} sequences cannot be split into {self.n_mini} minibatches")
