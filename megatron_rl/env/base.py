"""The environment contract: what one episode's environment does, and what the caller guarantees.

An **episode** is one task played by the model over one or more turns. Its environment is one object,
made for that episode and used by one thread at a time::

    env = EnvClass(**args)                 # cheap; shared, heavy resources live at class/module level
    try:
        observation = env.reset(task)      # list[Message]: shown before the first model turn ([] = none)
        while True:
            turn = <the model's turn, decoded>  # text, for parsing (tool calls, answers)
            result = env.step(turn)        # StepResult(observation, done, reward, info)
            if result.done:
                break
            <observation messages rendered once by the chat template, appended to the context>
    finally:
        env.close()                        # always, exactly once in effect (close is idempotent)
    outcome(task, result, turn)            # the episode's reward: see below

- ``task`` is the problem's task dict, the one ``megatron_rl.reward.score`` takes (``kind``,
  ``answer`` or ``tests``, ``problem``, ``meta``, ...). The caller renders the task's prompt as for a
  single-turn sample; the observation of ``reset`` (if any) follows it before the first model turn.
- ``turn`` is the decoded text of the model's turn, for the environment to parse. The turn's tokens
  stay the caller's: an environment never returns or rewrites the model's tokens, only new content.
- **Observations are chat messages** ``{"role": ..., "content": ...}`` (e.g. role ``"tool"`` for a
  tool's result, ``"user"`` for a user's reply). The caller renders them with the model's chat
  template exactly once and appends their tokens to the context; they carry no loss. An environment
  therefore never formats template markup itself (no ``<|im_start|>``, no ``<tool_response>``).
- **Outcome**: when ``step`` returns ``done=True``, ``reward`` is either a float -- the environment's
  own verdict, used as the episode's reward as is -- or ``None``: the final turn (the ``turn`` given to
  that last step) is graded by the existing verifiers, ``megatron_rl.reward.score(task, final_turn)``,
  like a single-turn response (in the verifier pool, under its limits). :func:`outcome` is that rule.
  An episode cut by the caller's caps (max turns, tokens, deadline) never got ``done``: its outcome is
  the caller's rule, not the environment's.
- **Failures**: anything the *model* does wrong (a malformed tool call, code that raises or times out)
  is an observation the model sees, never an exception. An exception from ``reset``/``step`` means the
  *environment* broke (its sandbox is unavailable, a bug, a lost service): the episode fails and is
  never trained as reward 0. Raise :class:`EnvFailure` (or anything) for that.
- **Resume by replay**: an episode in flight when the run stopped is continued by a new instance,
  reset on the same task and stepped with each recorded turn text in order; each replayed step must
  return the observation recorded then (and not done), after which the episode goes on. So an
  environment's answers should be a function of the task and the turns (seed randomness from the task)
  and a step safe to run twice; one that answers differently has its episode started over
  (``megatron_rl.rollout.episode``, "Turn boundaries and resume").
- ``tools``: the JSON schemas of the tools the environment offers (OpenAI/Hermes function format), for
  the caller to pass to ``apply_chat_template(..., tools=env.tools)`` so the template describes them.

Synchronous on purpose: the caller is a generator rank that already runs many episodes at once in
threads (``megatron_rl.rollout.generator`` uses a thread pool), and what environments wait on --
sandbox processes, subprocesses, HTTP, file I/O -- releases the GIL while it waits. A blocking
``step`` costs one thread of that pool, which a thread per in-flight episode already provides; an
``async`` API would make every author write non-blocking code (one blocking call in a coroutine stalls
every episode of the loop), need an event loop per generator thread, and buy nothing here, since
the concurrency that matters -- how many tool runs compete with generation for CPUs -- is capped by
:class:`megatron_rl.env.slots.ToolSlots`, not by the number of waiting episodes.
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypedDict

import numpy as np

from megatron_rl.reward import RewardBreakdown, score


class Message(TypedDict):
    """One chat message of an observation: rendered by the chat template, never by the environment."""

    role: str  # "tool", "user", ... (whatever the model's chat template knows)
    content: str


class EnvFailure(RuntimeError):
    """The environment itself broke (not the model): the episode fails, it is never reward 0."""


def check_observation(observation: Any, where: str = "observation") -> list[Message]:
    """``observation`` as a list of messages, or TypeError saying what is wrong (an environment bug).

    The messages are copied (a JSON round trip): the caller records them for a resume (checkpointed as
    JSON, compared with a replay's), so what it keeps must be what was rendered even if the environment
    later changes its own dicts, must survive JSON, and must compare equal after it (a tuple would come
    back a list)."""
    if not isinstance(observation, (list, tuple)):
        raise TypeError(f"{where} must be a list of {{'role', 'content'}} messages ([] for none), "
                        f"got {type(observation).__name__}")
    out: list[Message] = []
    for i, m in enumerate(observation):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"] \
                or not isinstance(m.get("content"), str):
            raise TypeError(f"{where}[{i}] must be a dict with a non-empty str 'role' and a str "
                            f"'content', got {m!r:.120}")
        try:  # the tokenizer takes only text that is UTF-8 (no lone surrogates)
            m["role"].encode("utf-8"), m["content"].encode("utf-8")
            copy = json.loads(json.dumps(m))  # extra keys (e.g. "name") are kept for templates that read them
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where}[{i}] must be JSON-serialisable text (it is checkpointed): "
                            f"{type(e).__name__}: {e}") from None
        out.append(copy)
    return out


def verdict(info: dict[str, Any]) -> bool | None:
    """``info["correct"]`` when it is a bool (numpy's too: ``(a == b).all()``), else None."""
    correct = info.get("correct")
    return bool(correct) if isinstance(correct, (bool, np.bool_)) else None


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` returns.

    observation: messages to show the model before its next turn; must be empty when ``done`` (no turn
        follows, so nothing would ever show it: put what you want logged in ``info``).
    done: the episode is over.
    reward: only meaningful when done: a finite float is the environment's own reward; None means
        "grade the final turn with megatron_rl.reward.score" (see :func:`outcome`). Must be None while
        not done (no per-turn rewards: advantages are per episode).
    info: JSON-serialisable facts for metrics and logs (e.g. tool_calls, tool_errors, tool_s). An
        optional bool ``info["correct"]`` tells :func:`outcome` whether an own reward counts as correct.
    """

    observation: list[Message] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "observation", check_observation(self.observation, "StepResult.observation"))
        if not isinstance(self.done, (bool, np.bool_)):  # numpy's: a comparison of arrays
            raise TypeError(f"StepResult.done must be a bool, got {self.done!r}")
        object.__setattr__(self, "done", bool(self.done))
        if self.done and self.observation:
            raise ValueError("StepResult: an observation with done=True would never be shown to the "
                             "model; return it with done=False, or log it in info")
        if self.reward is not None:
            if not self.done:
                raise ValueError(f"StepResult: reward={self.reward!r} before done (rewards are per episode)")
            # any real number (numpy's and torch's .item() too), never a bool; NaN or inf would reach the loss
            if isinstance(self.reward, (bool, np.bool_)) or not isinstance(self.reward, numbers.Real) \
                    or not math.isfinite(self.reward):
                raise TypeError(f"StepResult.reward must be a finite float or None, got {self.reward!r}")
            object.__setattr__(self, "reward", float(self.reward))
        if not isinstance(self.info, dict):
            raise TypeError(f"StepResult.info must be a dict, got {type(self.info).__name__}")


class Environment:
    """Base class of environments (subclassing is optional: any class with ``reset``, ``step`` and
    ``close`` loads). One instance per episode, used by one thread at a time; instances of one process
    run concurrently in threads, so class- or module-level state they share must be thread-safe.
    See the module docstring for the contract."""

    tools: ClassVar[list[dict[str, Any]]] = []  # tool schemas for apply_chat_template(tools=...)

    def reset(self, task: dict[str, Any]) -> list[Message]:
        """Start the episode on ``task``; the messages to show before the first turn ([]: none)."""
        raise NotImplementedError

    def step(self, turn: str) -> StepResult:
        """The model's turn (decoded text) -> what follows it."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode holds (workspace, processes). Called always, also after a failure
        or a cap; may be called again (must then do nothing)."""

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def outcome(task: dict[str, Any], last: StepResult, final_turn: str, config=None,
            num_tokens: int | None = None, **score_kwargs: Any) -> RewardBreakdown:
    """The reward of a finished episode: ``reward.score(task, final_turn, config, num_tokens,
    **score_kwargs)`` (e.g. the length stage's ``l_max``, ``l_cache``) when the
    environment left it to the verifiers (``last.reward is None``), else its own reward as a breakdown
    (``total`` = the reward; ``correct`` = ``info["correct"]`` when given, else reward > 0; the format
    and language checks were not run: format_ok True, language_ok None). ``final_turn`` is the turn the
    last step was given. The caller runs the verifiers where it grades single-turn samples (the pool)."""
    if not last.done:
        raise ValueError("outcome: the episode is not done (an episode cut by a cap has no outcome from "
                         "its environment)")
    if last.reward is None:
        return score(task, final_turn, config, num_tokens, **score_kwargs)
    return own_reward(last.reward, verdict(last.info))


def own_reward(reward: float, correct: bool | None = None) -> RewardBreakdown:
    """An environment's own verdict as a breakdown: ``total`` the reward, ``correct`` as given (None:
    reward > 0); the format and language checks were not run (format_ok True, language_ok None)."""
    return RewardBreakdown(format_ok=True, correct=reward > 0 if correct is None else correct, language_ok=None,
                           total=reward, details={"reward": "environment"})
