"""The turn loop's rules with a scripted model (the generator side: tests/e2e/test_episodes.py): each
request is the context so far, caps end an episode where they say (turns, tokens, deadline), an
observation is cut with a note, a turn cut by its cap gets its stop token as an environment token, and
an environment that raises fails the episode after closing it; an episode resumed at a turn boundary
continues exactly as the uninterrupted one, or raises when its environment replays differently. Tokens
and templates are SmolLM2's."""
from __future__ import annotations

import copy
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


# ---------------------------------------------------------------- environments written by others
class Returns(Echo):
    """Echo whose step (or reset) returns `bad` at its first call: an environment bug of one kind."""

    def __init__(self, bad, at="step"):
        super().__init__(turns=3)
        self.bad, self.at = bad, at

    def reset(self, task):
        first = super().reset(task)
        return self.bad() if self.at == "reset" else first

    def step(self, turn):
        super().step(turn)
        return self.bad()


def _nan_after_the_fact():
    from megatron_rl.env import StepResult

    result = StepResult(done=True, reward=1.0)
    object.__setattr__(result, "reward", float("nan"))  # past StepResult's own check
    return result


def _exits():
    raise SystemExit(3)


def _no_observation():
    from megatron_rl.env import StepResult

    return StepResult([])


BAD = {  # what an environment returns -> the start of its episode's one-line error
    "gym tuple": (lambda: ([], True, 1.0, {}), "step", "step: TypeError: step must return a StepResult"),
    "plain dict": (lambda: {"observation": [], "done": True, "reward": 1.0}, "step",
                   "step: TypeError: step must return a StepResult"),
    "None": (lambda: None, "step", "step: TypeError: step must return a StepResult"),
    "NaN set after": (_nan_after_the_fact, "step", "step: TypeError: StepResult.reward must be a finite float"),
    "nothing to answer": (_no_observation, "step", "step: ValueError: step returned done=False with no observation"),
    "sys.exit": (_exits, "step", "step: SystemExit: 3"),
    "reset None": (lambda: None, "reset", "reset: TypeError: reset's messages must be a list"),
    "reset dict": (lambda: {"role": "user", "content": "hi"}, "reset", "reset: TypeError: reset's messages must be"),
    "reset content parts": (lambda: [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "reset",
                            "reset: TypeError: reset's messages[0] must be a dict with"),
    "reset int content": (lambda: [{"role": "user", "content": 7}], "reset",
                          "reset: TypeError: reset's messages[0] must be a dict with"),
    "reset surrogate": (lambda: [{"role": "user", "content": "\ud800"}], "reset",
                        "reset: TypeError: reset's messages[0] must be JSON-serialisable text"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_what_an_environment_returns_is_checked_and_a_bad_return_fails_only_its_episode(chat, case):
    """A return the contract does not allow is the environment's failure: its episode fails with one line
    saying what was wrong (never an exception out of the episode that would stop the generator rank,
    never a reward the loss cannot take), and the environment is closed."""
    bad, at, error = BAD[case]
    env = Returns(bad, at)
    ep = run_episode(env, {}, PROMPT, Model(chat), 1000, EpisodeLimits(max_turns=5), chat)
    assert ep.report.stop == "env_error" and ep.report.error.startswith(error), ep.report.error
    assert "\n" not in ep.report.error and ep.report.reward is None and env.closed


def test_an_exception_with_an_empty_first_line_keeps_its_message(chat):
    class Terse(Echo):
        def step(self, turn):
            raise ValueError("\nthe real reason\nmore")

    ep = run_episode(Terse(), {}, PROMPT, Model(chat), 1000, EpisodeLimits(max_turns=5), chat)
    assert ep.report.error == "step: ValueError: the real reason"


def test_an_observation_the_chat_template_cannot_render_fails_the_episode(chat):
    """A role the model's template refuses is the environment's failure, not the generator rank's."""
    tok = copy.deepcopy(chat.tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'critic' %}{{ raise_exception('no critic "
                         "role') }}{% endif %}{% endfor %}" + tok.chat_template)
    strict = dataclasses.replace(chat, tokenizer=tok)

    class Critic(Echo):
        def step(self, turn):
            result = super().step(turn)
            return type(result)([{"role": "critic", "content": "hm"}]) if not result.done else result

    env = Critic(turns=3)
    ep = run_episode(env, {}, PROMPT, Model(chat), 1000, EpisodeLimits(max_turns=5), strict)
    assert ep.report.stop == "env_error" and env.closed
    assert ep.report.error.startswith("step's observation: TemplateError: the chat template cannot render an "
                                      "observation (critic)")


def test_numpy_verdicts_and_counts_in_info_are_read(chat):
    import numpy as np

    from megatron_rl.env import StepResult

    class Numpy(Echo):
        def step(self, turn):
            return StepResult(done=np.bool_(True), reward=np.float32(0.5),
                              info={"correct": np.bool_(False), "tool_calls": np.int64(2), "seen": {1, 2}})

    ep = run_episode(Numpy(), {}, PROMPT, Model(chat), 1000, EpisodeLimits(max_turns=5), chat)
    r = ep.report
    assert (r.stop, r.reward, r.correct, r.tool_calls) == ("done", 0.5, False, 2)
    assert type(r.reward) is float and type(r.correct) is bool


def test_an_environment_changing_its_task_changes_no_other_episodes(chat):
    """The episodes of a group share their task dict: each environment gets its own copy."""
    class Taker(Echo):
        def reset(self, task):
            self.answer = task.pop("answer")
            return super().reset(task)

    task = {"kind": "math", "answer": "6"}
    for _ in range(2):
        ep = run_episode(Taker(turns=1), task, PROMPT, Model(chat), 1000, EpisodeLimits(max_turns=5), chat)
        assert ep.report.stop == "done"
    assert task == {"kind": "math", "answer": "6"}


def test_the_messages_reset_shows_are_cut_like_any_observation(chat):
    class Verbose(Echo):
        def reset(self, task):
            super().reset(task)
            return [{"role": "user", "content": "y " * 5000}]

    ep = run_episode(Verbose(turns=1), {}, PROMPT, Model(chat), 1000, EpisodeLimits(1, None, 32), chat)
    text = chat.tokenizer.decode(ep.prompt_ids)
    shown = text.count("y") - chat.tokenizer.decode(PROMPT).count("y")
    assert shown == 32 and "[... output cut:" in text and len(ep.prompt_ids) < len(PROMPT) + 80


def test_what_is_recorded_is_what_was_shown_and_a_checkpoint_replays_it(chat):
    """The environment reuses (and changes) its message dict and gives a tuple in an extra key: the
    boundaries record what each observation was when shown, and an episode resumed from a checkpoint
    (JSON, where a tuple becomes a list) replays instead of diverging."""
    from megatron_rl.env import StepResult

    class Reuser(Echo):
        def reset(self, task):
            self.message = {"role": "tool", "content": "", "tags": ("a", "b")}
            return super().reset(task)

        def step(self, turn):
            result = super().step(turn)
            self.message["content"] = f"step {self.k}"
            return result if result.done else StepResult([self.message])

    seen = []
    full = run_episode(Reuser(turns=3), {}, PROMPT, ContextModel(chat, 1), 1000, EpisodeLimits(max_turns=9), chat,
                       on_boundary=lambda ep: seen.append(ep.partial("g", 0)))
    assert [o[0]["content"] for o in full.observations] == ["step 1", "step 2"]
    assert [o[0]["content"] for o in seen[0].observations] == ["step 1"]
    b = PartialEpisode.from_dict(json.loads(json.dumps(seen[1].to_dict())))
    ep = run_episode(Reuser(turns=3), {}, PROMPT, ContextModel(chat, 2), 1000, EpisodeLimits(max_turns=9), chat,
                     start=b)
    assert ep.report.resumed_turns == 2 and ep.ids == full.ids
