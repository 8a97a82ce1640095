"""The turn loop's rules with a scripted model (the generator side: tests/e2e/test_episodes.py): each
request is the context so far, caps end an episode where they say (turns, tokens, deadline), an
observation is cut with a note, a turn cut by its cap gets its stop token as an environment token, and
an environment that raises fails the episode after closing it; an episode resumed at a turn boundary
continues exactly as the uninterrupted one, or raises when its environment replays differently. Tokens
and templates are SmolLM2's."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from megatron_rl.data.prompts import get_template
from megatron_rl.data.turns import ChatTurns
from megatron_rl.env import Echo
from megatron_rl.records import ENV_VERSION, PartialEpisode
from megatron_rl.rollout.episode import TRUNCATED_NOTE, EpisodeLimits, ReplayDiverged, run_episode
from megatron_rl.rollout.outputs import Turn

PROMPT: list[int] = []  # a rendered prompt (the chat fixture sets it): the environment's first message goes in it


@pytest.fixture(scope="module")
def chat():
    from megatron_rl.train.hf_source import resolve_model

    tok = resolve_model("smollm2-135m").tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    PROMPT[:] = tok(text, add_special_tokens=False).input_ids
    return ChatTurns(tok, get_template("none"))


class Model:
    """Answers each request with `n` tokens (capped by its max_new_tokens), ending with the stop token
    unless the cap cut it; keeps every request."""

    def __init__(self, chat, n=5, delay_s=0.0):
        self.chat, self.n, self.delay_s, self.requests = chat, n, delay_s, []

    def __call__(self, context, max_new_tokens):
        self.requests.append((list(context), max_new_tokens))
        time.sleep(self.delay_s)
        k = min(self.n, max_new_tokens)
        stopped = k == self.n
        ids = list(range(100, 100 + k - 1)) + [self.chat.stop_ids[0] if stopped else 99]
        return Turn(ids, [-0.5] * k, [7] * k, "stop" if stopped else "length", f"turn {len(self.requests)}")


def test_each_request_is_the_context_so_far_and_env_tokens_are_masked(chat):
    model = Model(chat)
    ep = run_episode(Echo(turns=3), {}, PROMPT, model, 1000, EpisodeLimits(max_turns=5), chat)
    assert ep.report.turns == 3 and ep.report.stop == "done" and len(model.requests) == 3
    assert ep.prompt_ids == chat.prompt_ids_with(PROMPT, [{"role": "user", "content": "Echo: reply 3 times."}])
    for k, (context, _) in enumerate(model.requests):
        assert context == ep.prompt_ids + ep.ids[:len(context) - len(ep.prompt_ids)]
    first_obs = chat.observation_ids([{"role": "user", "content": "echo 1: turn 1"}])
    assert ep.ids[5:5 + len(first_obs)] == first_obs and ep.mask[5:5 + len(first_obs)] == [0] * len(first_obs)
    assert ep.versions[5] == ENV_VERSION and ep.mask.count(1) == 15 and ep.text == "turn 3"


def test_max_turns_ends_the_episode_on_its_last_turn(chat):
    ep = run_episode(Echo(turns=5), {}, PROMPT, Model(chat), 1000, EpisodeLimits(max_turns=2), chat)
    assert ep.report.turns == 2 and ep.report.stop == "max_turns" and ep.mask[-1] == 1


def test_the_token_cap_bounds_model_and_environment_tokens(chat):
    model = Model(chat, n=20)
    ep = run_episode(Echo(turns=9), {}, PROMPT, model, 60, EpisodeLimits(max_turns=9), chat)
    assert ep.report.stop == "max_tokens" and ep.finish_reason == "length" and len(ep.ids) <= 60
    assert all(prompt_len - len(ep.prompt_ids) + n <= 60 for (prompt_len, n) in
               ((len(c), n) for c, n in model.requests))  # no request may run past the cap


def test_a_turn_cut_by_its_cap_gets_the_stop_token_as_an_environment_token(chat):
    model = Model(chat, n=20)
    ep = run_episode(Echo(turns=2), {}, PROMPT, model, 1000, EpisodeLimits(max_turns=2, max_turn_tokens=4), chat)
    assert [n for _, n in model.requests] == [4, 4]
    assert ep.ids[4] == chat.stop_ids[0] and ep.mask[3:5] == [1, 0]


def test_a_turn_stopped_by_another_token_than_the_templates_end_of_turn_gets_the_end_of_turn_added(chat):
    """finish_reason "stop" on a token that is not one of the template's stop ids (the tokenizer's eos when
    the turn end is another token, a sampling stop): the context must still read as the template renders
    the conversation, so the observation begins with the end-of-turn id."""
    other = 42
    assert other not in chat.stop_ids

    def model(context, max_new_tokens):
        return Turn([100, 101, other], [-0.5] * 3, [7] * 3, "stop", "said")

    ep = run_episode(Echo(turns=2), {}, PROMPT, model, 1000, EpisodeLimits(max_turns=2), chat)
    assert ep.ids[3] == chat.stop_ids[0] and ep.mask[2:4] == [1, 0]
    assert ep.ids[3:ep.mask.index(1, 3)] == [chat.stop_ids[0]] + chat.observation_ids(
        [{"role": "user", "content": "echo 1: said"}])


def test_a_long_observation_is_cut_with_a_note(chat):
    class Loud(Echo):
        def step(self, turn):
            result = super().step(turn)
            return type(result)([{"role": "tool", "content": "x " * 500}]) if not result.done else result

    ep = run_episode(Loud(turns=2), {}, PROMPT, Model(chat), 5000, EpisodeLimits(2, None, 32), chat)
    env = [t for t, m in zip(ep.ids, ep.mask) if not m]
    text = chat.tokenizer.decode(env)
    n = len(chat.tokenizer("x " * 500, add_special_tokens=False).input_ids)
    assert TRUNCATED_NOTE.format(n=n - 32).strip() in text and text.count("x") == 32


def test_the_deadline_stops_starting_turns(chat):
    ep = run_episode(Echo(turns=9), {}, PROMPT, Model(chat, delay_s=0.2), 1000,
                     EpisodeLimits(max_turns=9, deadline_s=0.3), chat)
    assert ep.report.stop == "deadline" and ep.report.turns == 2


def test_a_raising_environment_fails_the_episode_and_is_closed(chat):
    env = Echo(turns=3, fail_at=2)
    ep = run_episode(env, {}, PROMPT, Model(chat), 1000, EpisodeLimits(max_turns=5), chat)
    assert ep.report.stop == "env_error" and ep.report.error.startswith("step: EnvFailure") and env.closed


def test_the_model_failing_is_not_the_environment_failing(chat):
    env = Echo(turns=3)

    def broken(context, n):
        raise ConnectionError("server gone")

    with pytest.raises(ConnectionError):
        run_episode(env, {}, PROMPT, broken, 1000, EpisodeLimits(max_turns=5), chat)
    assert env.closed


# ---------------------------------------------------------------- turn boundaries and resume
class ContextModel:
    """A deterministic model: each turn's tokens and text are a function of the context alone (so an
    episode continued from a boundary samples what the uninterrupted one did), stamped `version`."""

    def __init__(self, chat, version, n=4):
        self.chat, self.version, self.n, self.requests = chat, version, n, []

    def __call__(self, context, max_new_tokens):
        self.requests.append(list(context))
        ids = [100 + (len(context) * 7 + j) % 50 for j in range(self.n - 1)] + [self.chat.stop_ids[0]]
        return Turn(ids, [-0.25] * self.n, [self.version] * self.n, "stop", f"said {len(context)}")


def _boundaries(chat, turns=4):
    seen = []
    full = run_episode(Echo(turns=turns), {}, PROMPT, ContextModel(chat, 1), 1000, EpisodeLimits(max_turns=9), chat,
                       on_boundary=lambda ep: seen.append(ep.partial("g", 3)))
    return full, seen


@pytest.mark.parametrize("k", [0, 1, 2])
def test_an_episode_resumed_at_a_boundary_keeps_its_turns_and_samples_only_the_rest(chat, k):
    full, seen = _boundaries(chat)
    assert [b.report.turns for b in seen] == [1, 2, 3]  # one after each observation, none after the last turn
    b = PartialEpisode.from_dict(json.loads(json.dumps(seen[k].to_dict())))  # as a checkpoint holds it
    assert b.key == ("g", 3) and full.ids[:len(b.ids)] == b.ids and b.prompt_ids == full.prompt_ids
    model = ContextModel(chat, 2)
    env = Echo(turns=4)
    ep = run_episode(env, {}, PROMPT, model, 1000, EpisodeLimits(max_turns=9), chat, start=b)
    # nothing recorded is sampled again: the first request is the recorded context, one per turn left
    assert model.requests[0] == b.prompt_ids + b.ids and len(model.requests) == 4 - b.report.turns
    assert (ep.prompt_ids, ep.ids, ep.mask, ep.logprobs) == (full.prompt_ids, full.ids, full.mask, full.logprobs)
    n = len(b.ids)  # the recorded tokens keep the version that sampled them; the rest are the new weights'
    assert ep.versions[:n] == full.versions[:n]
    assert {v for v, m in zip(ep.versions[n:], ep.mask[n:]) if m} == {2}
    assert ep.report.turns == 4 and ep.report.resumed_turns == b.report.turns and ep.report.stop == "done"
    assert ep.text == full.text and env.closed


def test_a_replay_the_environment_answers_differently_raises_and_closes_it(chat):
    _, seen = _boundaries(chat)

    class Forgetful(Echo):  # a new instance answers a replayed turn with other content
        def step(self, turn):
            result = super().step(turn)
            for m in result.observation:
                m["content"] += " (again)"
            return result

    env = Forgetful(turns=4)
    with pytest.raises(ReplayDiverged, match="turn 1 replayed"):
        run_episode(env, {}, PROMPT, ContextModel(chat, 2), 1000, EpisodeLimits(max_turns=9), chat, start=seen[1])
    assert env.closed


def test_a_resumed_episode_counts_the_time_it_already_ran_against_its_deadline(chat):
    _, seen = _boundaries(chat)
    b = dataclasses.replace(seen[0], elapsed_s=100.0)
    ep = run_episode(Echo(turns=4), {}, PROMPT, ContextModel(chat, 2), 1000,
                     EpisodeLimits(max_turns=9, deadline_s=50.0), chat, start=b)
    assert ep.report.stop == "deadline" and ep.report.turns == 2  # one turn after the resume, then past it
