"""The turn loop's rules with a scripted model (the generator side: tests/e2e/test_episodes.py): each
request is the context so far, caps end an episode where they say (turns, tokens, deadline), an
observation is cut with a note, a turn cut by its cap gets its stop token as an environment token, and
an environment that raises fails the episode after closing it. Tokens and templates are SmolLM2's."""
from __future__ import annotations

import time

import pytest

from megatron_rl.data.prompts import get_template
from megatron_rl.data.turns import ChatTurns
from megatron_rl.env import Echo
from megatron_rl.records import ENV_VERSION
from megatron_rl.rollout.episode import TRUNCATED_NOTE, EpisodeLimits, run_episode
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
