"""The turn loop of an episode: token in, token out, exactly.

One episode is one sample of a group: its environment starts on the task; each model turn is one
/generate request whose input is the context so far; the environment answers the turn's text with
chat messages, whose ids (`ChatTurns.observation_ids`, the chat template's rendering, encoded once)
are appended; until the environment says done or a cap ends it. The context grows only by the sampled
ids (stop token included: SGLang returns it) and by observation ids: nothing sampled is decoded and
encoded again, and the history is never re-rendered. So the completion the trainer scores is exactly
the token sequence the generator sampled in and the model saw.

Routing replay: each turn's routed experts (`Turn.routes`, asked from the first position the episode
holds none of) extend `Episode.routes`; a turn's rows replace any the episode held from their first
position on, so a position keeps the routes of the last request that returned them. A turn without
routes (aborted) leaves the episode with none: the trainer then routes it itself.

Every sampled token keeps its behaviour logprob and the weight version that produced it (an in-place
update inside a turn splits the turn's versions); environment tokens get loss_mask 0 and the
placeholders ENV_LOGPROB / ENV_VERSION. A turn after a weight update is a new request under the new
cache salt (`PrefixCachePolicy`), so it prefills under the new weights instead of reusing old KV.

Caps (the `env` config): `max_turns` model turns; `deadline_s` the episode's wall time (no turn starts
after it); the length stage's cap bounds every token after the
prompt (model and environment: the context the KV cache holds); `max_turn_tokens` one turn; an
observation message longer than `max_observation_tokens` is cut with a note the model sees (`reset`'s
too). An episode a cap ends is graded on its last turn. An environment that raises, or returns what the
contract does not allow (checked here again: a StepResult changed after it was made, a class of its own,
messages the chat template cannot render), fails the episode (`report.error`): it is never trained, its
group is dropped. It gets its own copy of the task (a group's episodes share theirs).

Turn boundaries and resume: after each observation (the context ready for the next model turn),
`on_boundary` gets the episode so far, which the generator reports as a `PartialEpisode`; the
controller checkpoints the latest one. `start=` continues such an episode: a new environment is reset
on the task and every recorded turn text is stepped through it again (replay), each step's
observation checked against the recorded one; the recorded tokens, logprobs, versions and report are
then taken as they were and the episode goes on from the boundary. Replay rebuilds whatever state the
environment keeps (a tool's workspace files) without any environment code for it; an environment that
answers a replayed turn differently (randomness, a clock, outside state) raises `ReplayDiverged`, and the
caller starts the episode over: its context would no longer match its environment.
"""
from __future__ import annotations

import copy
import dataclasses
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from megatron_rl.data.turns import ChatTurns
from megatron_rl.env import SingleTurn, StepResult, check_observation, verdict
from megatron_rl.records import ENV_LOGPROB, ENV_VERSION, EpisodeReport, FinishReason, PartialEpisode
from megatron_rl.rollout.outputs import Turn

TRUNCATED_NOTE = "\n[... output cut: {n} more tokens]"


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 1
    max_turn_tokens: int | None = None  # None: the stage's cap
    max_observation_tokens: int = 1024
    deadline_s: float | None = None  # wall time of an episode after which no turn starts (None: none)


@dataclass(frozen=True)
class EpisodeSetup:
    """What a generator needs to play episodes: a new environment per episode, the caps, and the
    renderer of observations (None: environments that show nothing, e.g. the single-turn task)."""

    make_env: Callable[[], Any] = SingleTurn
    limits: EpisodeLimits = EpisodeLimits()
    turns: ChatTurns | None = None


@dataclass
class Episode:
    """What an episode produced: the prompt (with the environment's first messages, if any) and the
    completion, token by token."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    text: str = ""  # the last model turn: what the verifiers grade
    report: EpisodeReport = field(default_factory=lambda: EpisodeReport(turns=0))
    turn_texts: list[str] = field(default_factory=list)  # every model turn's text, in order
    observations: list[list[dict[str, str]]] = field(default_factory=list)  # as shown after each turn
    started: float = field(default_factory=time.monotonic)  # when it began (a resumed one: earlier)
    # [positions, layers, topk] routed experts of prompt + ids but the last token (routing replay); None: none
    routes: np.ndarray | None = None

    def add_turn(self, turn: Turn) -> None:
        self.routes = self._routes_after(turn)
        self.ids += turn.ids
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        self.mask += [1] * len(turn.ids)
        self.finish_reason, self.text = turn.finish_reason, turn.text
        self.turn_texts.append(turn.text)
        self.report.turns += 1
        self.report.prompt_tokens += turn.prompt_tokens
        self.report.cached_tokens += turn.cached_tokens

    def _routes_after(self, turn: Turn) -> np.ndarray | None:
        """The episode's routes with `turn`'s (before its ids are added): None when the turn has none or
        they start past the positions held."""
        if turn.routes is None:
            return None
        start = len(self.prompt_ids) + len(self.ids) + len(turn.ids) - 1 - len(turn.routes)
        held = self.routes[:start] if self.routes is not None else turn.routes[:0]
        return np.concatenate([held, turn.routes]) if len(held) == start else None

    def add_observation(self, messages: list[dict[str, str]], ids: list[int]) -> None:
        self.observations.append(messages)
        self.ids += ids
        self.logprobs += [ENV_LOGPROB] * len(ids)
        self.versions += [ENV_VERSION] * len(ids)
        self.mask += [0] * len(ids)
        self.report.env_tokens += len(ids)

    def add_info(self, info: dict[str, Any], seconds: float) -> None:
        r = self.report
        r.tool_s += seconds
        for key in ("tool_calls", "tool_errors", "tool_timeouts"):
            value = info.get(key, 0)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy's ints too
                setattr(r, key, getattr(r, key) + int(value))

    @property
    def loss_mask(self) -> list[int] | None:
        """None when every completion token is the model's (the single-turn form)."""
        return None if all(self.mask) else self.mask

    def partial(self, group_id: str, sample_index: int) -> PartialEpisode:
        """The episode so far, at a turn boundary (copies: the episode goes on)."""
        return PartialEpisode(group_id, sample_index, list(self.prompt_ids), list(self.ids), list(self.logprobs),
                              list(self.versions), list(self.mask), list(self.turn_texts),
                              [list(o) for o in self.observations], dataclasses.replace(self.report),
                              time.monotonic() - self.started)

    def restore(self, p: PartialEpisode) -> None:
        """Take a recorded episode's turns as they were (after its environment replayed them)."""
        self.ids, self.logprobs, self.versions, self.mask = list(p.ids), list(p.logprobs), list(p.versions), list(p.mask)
        self.turn_texts, self.observations = list(p.turns), [list(o) for o in p.observations]
        self.text = p.turns[-1]
        self.report = dataclasses.replace(p.report, resumed_turns=p.report.turns)
        self.started = time.monotonic() - p.elapsed_s


def run_episode(env, task: dict[str, Any], prompt_ids: list[int], sample: Callable[[list[int], int], Turn],
                cap: int, limits: EpisodeLimits, turns: ChatTurns | None, start: PartialEpisode | None = None,
                on_boundary: Callable[[Episode], None] | None = None) -> Episode:
    """Play one episode. `sample(context_ids, max_new_tokens)` runs one model turn; `cap` bounds every
    token after the prompt; `turns` renders observations (None: an environment that shows none, the
    single-turn task). `start`: continue this recorded episode (ReplayDiverged when the environment does
    not replay it); `on_boundary(episode)` at every turn boundary. The environment is closed on every
    way out."""
    episode = Episode(list(prompt_ids))
    try:
        # a copy: the episodes of a group share their task dict, and an environment may change what it is given
        first = _env("reset", env.reset, copy.deepcopy(task), check=_messages)
        if first:
            if turns is None:
                raise RuntimeError("the environment shows messages but the tokenizer has no chat template")
            shown = _cut(turns, first, limits.max_observation_tokens)  # they are an observation too
            episode.prompt_ids = _env("reset's messages", turns.prompt_ids_with, prompt_ids, shown)
        if start is not None:
            _replay(env, episode, start, limits, turns)
        _play(env, episode, sample, cap, limits, turns, on_boundary or (lambda episode: None))
    except EnvironmentBroke as e:
        episode.report.stop, episode.report.error = "env_error", str(e)
    finally:
        try:
            env.close()
        except Exception as e:  # a failed close fails the episode too: its resources may leak
            episode.report.stop, episode.report.error = "env_error", f"close: {type(e).__name__}: {e}"
    return episode


class EnvironmentBroke(Exception):
    """The environment raised (reset, step or close): the episode fails, the run goes on."""


class ReplayDiverged(Exception):
    """A new environment answered a recorded episode's turns differently: the episode cannot continue."""


def _replay(env, episode: Episode, start: PartialEpisode, limits: EpisodeLimits, turns: ChatTurns | None) -> None:
    """Step `start`'s turns through the freshly reset `env`; each must answer what was recorded."""
    if episode.prompt_ids != start.prompt_ids:
        raise ReplayDiverged("reset shows different messages than when the episode began")
    for k, (text, seen) in enumerate(zip(start.turns, start.observations), 1):
        result = _env("step", env.step, text, check=_step_result)
        if result.done or turns is None or _cut(turns, result.observation, limits.max_observation_tokens) != seen:
            raise ReplayDiverged(f"turn {k} replayed: the environment answered differently than recorded")
    episode.restore(start)


def _env(name: str, method, *args, check: Callable[[Any], Any] | None = None):
    """`method(*args)`, passed through `check`: what either raises is the environment's failure, an
    EnvironmentBroke whose one line starts with `name` (a chat template that cannot render the
    environment's messages, e.g. a role it does not know, is one too)."""
    try:
        result = method(*args)
        return result if check is None else check(result)
    except (Exception, SystemExit) as e:  # sys.exit() in an environment ends its episode, not the rank
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), None)
        raise EnvironmentBroke(": ".join(p for p in (name, type(e).__name__, first) if p)) from e


def _messages(result: Any) -> list[dict[str, Any]]:
    return check_observation(result, "reset's messages")


_FIELDS = ("observation", "done", "reward", "info")


def _step_result(result: Any) -> StepResult:
    """What `step` returned, checked again as a StepResult: a class of the environment's own with the
    same fields, or a StepResult changed after it was made, must not reach the loss unchecked (a NaN
    reward, a message that is no text)."""
    if not all(hasattr(result, f) for f in _FIELDS):
        raise TypeError(f"step must return a StepResult(observation, done, reward, info), got "
                        f"{type(result).__name__} {result!r:.80}")
    checked = StepResult(*(getattr(result, f) for f in _FIELDS))
    if not checked.done and not checked.observation:  # the template cannot put a turn right after a turn
        raise ValueError("step returned done=False with no observation: the model's next turn needs a "
                         "message to answer (or return done=True)")
    return checked


def _play(env, episode: Episode, sample, cap: int, limits: EpisodeLimits, turns: ChatTurns | None,
          on_boundary: Callable[[Episode], None]) -> None:
    report = episode.report
    deadline = None if limits.deadline_s is None else episode.started + limits.deadline_s
    while True:
        room = cap - len(episode.ids)
        if room < 1:  # a resumed episode under a shorter length stage than it began in
            report.stop, episode.finish_reason = "max_tokens", "length"
            return
        turn = sample(episode.prompt_ids + episode.ids, min(room, limits.max_turn_tokens or room))
        episode.add_turn(turn)
        if turn.finish_reason == "abort":
            report.stop = "abort"
            return
        started = time.perf_counter()
        result = _env("step", env.step, turn.text, check=_step_result)
        episode.add_info(result.info, time.perf_counter() - started)
        if result.done:
            report.reward, report.correct = result.reward, verdict(result.info)
            return
        if report.turns >= limits.max_turns:
            report.stop = "max_turns"
            return
        if deadline is not None and time.monotonic() >= deadline:
            report.stop = "deadline"
            return
        if turns is None:
            raise RuntimeError("the environment continues after a turn but the tokenizer has no chat template")
        shown = _cut(turns, result.observation, limits.max_observation_tokens)
        observation = _env("step's observation", turns.observation_ids, shown, turns.ends_turn(turn.ids))
        if len(episode.ids) + len(observation) >= cap:  # no room left for a model token after it
            report.stop = "max_tokens"
            episode.finish_reason = "length"
            return
        episode.add_observation(shown, observation)
        on_boundary(episode)


def _cut(turns: ChatTurns, messages: list[dict[str, str]], limit: int) -> list[dict[str, str]]:
    """Messages whose content is at most `limit` tokens (cut at a token boundary, with a note)."""
    out = []
    for m in messages:
        ids = turns.tokenizer(m["content"], add_special_tokens=False).input_ids
        if len(ids) > limit:
            m = dict(m, content=turns.tokenizer.decode(ids[:limit]) + TRUNCATED_NOTE.format(n=len(ids) - limit))
        out.append(m)
    return out
