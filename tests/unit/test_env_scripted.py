"""The contract's records and rule (StepResult, outcome) and the two small built-ins: Echo (scripted)
and SingleTurn (a single-turn task as a one-turn episode), graded by reward.score."""
from __future__ import annotations

import math

import pytest

from megatron_rl.env import Echo, EnvFailure, Environment, SingleTurn, StepResult, outcome
from megatron_rl.reward import score

TASK = {"kind": "math", "answer": "56088", "problem": "What is 123 times 456?"}
RIGHT = "<think>I multiply the two numbers carefully.</think>\nThe product is $\\boxed{56088}$."
WRONG = "<think>I multiply the two numbers carefully.</think>\nThe product is $\\boxed{56078}$."


def _graded(b) -> tuple:
    return (b.status, b.format_ok, b.correct, b.language_ok, b.total)


def test_echo_is_exactly_scripted():
    env = Echo(turns=3)
    assert env.reset(TASK) == [{"role": "user", "content": "Echo: reply 3 times."}]
    first = env.step("  hello there \n")
    assert first == StepResult([{"role": "user", "content": "echo 1: hello there"}], info={"turn": 1})
    assert env.step("again") == StepResult([{"role": "user", "content": "echo 2: again"}], info={"turn": 2})
    last = env.step(RIGHT)
    assert last == StepResult([], done=True, reward=None, info={"turn": 3})
    with pytest.raises(RuntimeError, match="not running"):
        env.step("one more")
    env.close()
    env.close()  # idempotent
    assert env.closed
    # reward None: the final turn is graded by reward.score, right and wrong
    assert _graded(outcome(TASK, last, RIGHT)) == _graded(score(TASK, RIGHT))
    assert outcome(TASK, last, RIGHT).correct and not outcome(TASK, last, WRONG).correct


def test_echo_own_reward_and_failure():
    with Echo(turns=1, reward=0.25) as env:  # a context manager closes it
        env.reset(TASK)
        last = env.step("anything")
    assert env.closed and (last.done, last.reward) == (True, 0.25)
    own = outcome(TASK, last, "anything")  # the environment's reward, no verifier involved
    assert (own.total, own.correct, own.format_ok, own.language_ok, own.details) == (
        0.25, True, True, None, {"reward": "environment"})
    zero = outcome(TASK, StepResult(done=True, reward=0.0), RIGHT)
    assert (zero.total, zero.correct) == (0.0, False)  # the right text does not matter
    told = outcome(TASK, StepResult(done=True, reward=0.5, info={"correct": False}), RIGHT)
    assert (told.total, told.correct) == (0.5, False)
    env = Echo(turns=3, fail_at=2)
    env.reset(TASK)
    env.step("fine")
    with pytest.raises(EnvFailure, match="scripted failure at step 2"):
        env.step("boom")


def test_echo_steps_take_their_delay_and_a_bad_one_is_refused():
    import time

    env = Echo(turns=2, delay_s=0.2)
    env.reset(TASK)
    t0 = time.perf_counter()
    env.step("slow")
    assert time.perf_counter() - t0 >= 0.2
    with pytest.raises(ValueError, match="delay_s must be a number >= 0"):
        Echo(delay_s=-1)


def test_single_turn_is_a_one_turn_episode_graded_by_reward_score():
    for response in (RIGHT, WRONG):
        env = SingleTurn()
        assert env.reset(TASK) == []  # no observation: the prompt is the task's
        result = env.step(response)
        assert result == StepResult(done=True)
        env.close()
        graded = outcome(TASK, result, response)
        assert _graded(graded) == _graded(score(TASK, response))
        assert graded.correct == (response is RIGHT)
    assert outcome(TASK, result, RIGHT).total > outcome(TASK, result, WRONG).total
    env = SingleTurn()
    with pytest.raises(RuntimeError, match="one step per reset"):
        env.step(RIGHT)  # before reset
    env.reset(TASK)
    env.step(RIGHT)
    with pytest.raises(RuntimeError, match="one step per reset"):
        env.step(RIGHT)


def test_step_result_checks_what_an_environment_returns():
    with pytest.raises(ValueError, match="would never be shown"):
        StepResult([{"role": "user", "content": "late"}], done=True)
    with pytest.raises(ValueError, match="before done"):
        StepResult([], reward=1.0)
    for bad in (math.nan, math.inf, True, "1"):
        with pytest.raises(TypeError, match="finite float or None"):
            StepResult(done=True, reward=bad)
    for obs in ("text", [{"role": "user"}], [{"role": "", "content": "x"}], [("user", "x")],
                [{"role": "tool", "content": b"bytes"}]):
        with pytest.raises(TypeError, match="observation"):
            StepResult(obs)
    with pytest.raises(TypeError, match="done must be a bool"):
        StepResult(done=1)
    with pytest.raises(TypeError, match="info must be a dict"):
        StepResult(info=[])
    assert StepResult(done=True, reward=1).reward == 1.0 and isinstance(StepResult(done=True, reward=1).reward, float)
    with pytest.raises(ValueError, match="not done"):
        outcome(TASK, StepResult(), RIGHT)


def test_base_class_defaults():
    class Minimal(Environment):
        def reset(self, task):
            return []

        def step(self, turn):
            return StepResult(done=True)

    env = Minimal()
    assert env.tools == [] and env.close() is None
    with pytest.raises(NotImplementedError):
        Environment().step("x")


def test_numpy_values_an_author_computes_are_taken_as_python_ones():
    """A reward from numpy (np.float32, np.int64) or a done/correct from an array comparison (np.bool_)
    is what an author means; a bool reward stays refused (True is no score), and so do NaN and inf."""
    import numpy as np

    for reward in (np.float32(0.75), np.float64(0.75), np.int64(1)):
        result = StepResult(done=True, reward=reward)
        assert type(result.reward) is float and result.reward == float(reward)
    result = StepResult(done=np.bool_(True), reward=1.0)
    assert result.done is True
    for bad in (np.bool_(True), np.float64("nan"), np.float32("inf")):
        with pytest.raises(TypeError, match="finite float or None"):
            StepResult(done=True, reward=bad)
    told = outcome(TASK, StepResult(done=True, reward=1.0, info={"correct": np.bool_(False)}), RIGHT)
    assert (told.total, told.correct) == (1.0, False)


def test_observation_messages_are_copied_and_must_survive_a_checkpoint():
    """The messages are recorded for a resume (JSON in a checkpoint, compared with a replay's): a copy,
    so the environment changing its dict later changes nothing recorded, with a tuple read back as the
    list JSON gives; a value JSON cannot hold, or text the tokenizer cannot take, is refused now."""
    import numpy as np

    from megatron_rl.env import check_observation

    message = {"role": "tool", "content": "ok", "tags": ("a", "b")}
    (kept,) = check_observation([message])
    message["content"] = "changed"
    assert kept == {"role": "tool", "content": "ok", "tags": ["a", "b"]}
    for bad in ({"role": "tool", "content": "x", "id": np.int64(3)}, {"role": "tool", "content": "x", "ids": {1}},
                {"role": "user", "content": "lone \ud800 surrogate"}):
        with pytest.raises(TypeError, match=r"observation\[0\] must be JSON-serialisable text"):
            StepResult([bad])
