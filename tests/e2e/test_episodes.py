"""Multi-turn episodes on a real SGLang server (CPU, tiny random Llama), checked against HF transformers.

Token in, token out: each turn's request is exactly the previous request's input, its sampled ids (stop
token included) and the observation's ids; the rollout's completion is that sequence; the behaviour
logprobs at sampled positions equal HF's log-softmax on the rollout's own ids (so what the trainer scores
is what the generator sampled in); environment tokens carry mask 0, no logprob and no version. A weight
update between turns: the next turn prefills under the new weights (no cached prefix) and its tokens
carry the new version, equal to HF on the new weights. An episode continued from a turn boundary (as a
resume does) samples only its remaining turns, from exactly the recorded context.
"""
from __future__ import annotations

import functools

import pytest
import torch

from megatron_rl.data.prompts import get_template
from megatron_rl.data.turns import ChatTurns
from megatron_rl.env import Echo, EnvFailure
from megatron_rl.records import ENV_LOGPROB, ENV_VERSION, GroupRequest
from megatron_rl.rollout.episode import EpisodeLimits, EpisodeSetup
from megatron_rl.sync.sender import WeightSender
from megatron_rl.sync.update import push_in_process, target_of
from support.runs import RecordedClient
from test_generator import gen, hf, named, perturbed  # noqa: F401 (gen, hf: the module's server and HF model)

pytestmark = pytest.mark.timeout(900)
PROMPT = [{"role": "user", "content": "1 + 1 ="}]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def newline(tok):
    ids = tok("\n", add_special_tokens=False).input_ids
    assert len(ids) == 1, "the tiny template ends a turn with a newline: it must be one token"
    return ids[0]


def play(gen, tok, newline, make_env, turns=5, turn_tokens=10, cap=200, resume=None):
    chat = ChatTurns(tok, get_template("none"), stop_ids=(newline,))
    gen.episodes = EpisodeSetup(make_env, EpisodeLimits(turns, turn_tokens, 64), chat)
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    recorded = gen.server.client = RecordedClient(gen.server.client)
    try:
        gen.submit_group(GroupRequest("g", tok(prompt, add_special_tokens=False).input_ids, [0],
                                      sampling={"temperature": 1.0, "max_new_tokens": cap,
                                                "stop_token_ids": [newline]}, task={"kind": "math", "answer": "2"},
                                      resume={0: resume} if resume else {}))
        (r,) = gen.completions(timeout=600)
    finally:
        gen.server.client = recorded.client
    assert gen.env_waiting == 0  # an ended episode waits on nothing (the controller's admission reads it)
    return r, recorded.calls, chat


def runs(mask):
    """(start, end, is_model) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, bool(mask[start])))
            start = i
    return out


@torch.no_grad()
def hf_logprobs(model, ids, temperature=1.0):
    x = torch.tensor([ids])
    lp = torch.log_softmax(model(x).logits[0, :-1].float() / temperature, -1)
    return lp.gather(-1, x[0, 1:, None])[:, 0]  # logprob of token i+1 given ids[:i+1]


def test_three_turns_token_in_token_out(gen, tok, newline, hf):
    r, calls, chat = play(gen, tok, newline, functools.partial(Echo, turns=3))
    assert r.episode.turns == 3 == len(calls) and r.episode.stop == "done" and r.episode.error is None
    segments = runs(r.loss_mask)
    model = [(a, b) for a, b, m in segments if m]
    assert len(model) == 3 and [m for *_, m in segments] == [True, False, True, False, True]
    for k, ((body, out), (a, b)) in enumerate(zip(calls, model)):
        # the request is the prompt (with the environment's first message) and everything before the turn
        assert body["input_ids"] == r.prompt_ids + r.completion_ids[:a]
        assert r.completion_ids[a:b] == out["output_ids"]  # sampled ids kept as sampled (stop token too)
        if k:
            assert out["meta_info"]["cached_tokens"] > 0  # no update: the context's prefix is reused
    # the environment's tokens: its messages rendered once by the chat template, nothing else
    prompt_text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert r.prompt_ids == chat.prompt_ids_with(tok(prompt_text, add_special_tokens=False).input_ids,
                                                [{"role": "user", "content": "Echo: reply 3 times."}])
    for k, (a, b, is_model) in enumerate(segments):
        if is_model:
            continue
        turn = calls[k // 2][1]
        said = tok.decode(turn["output_ids"], skip_special_tokens=True)
        stopped = turn["output_ids"][-1] == newline
        expected = chat.observation_ids([{"role": "user", "content": f"echo {k // 2 + 1}: {said.strip()}"}], stopped)
        assert r.completion_ids[a:b] == expected
        assert r.behaviour_logprobs[a:b] == [ENV_LOGPROB] * (b - a) and r.weight_versions[a:b] == [ENV_VERSION] * (b - a)
    assert r.episode.env_tokens == r.loss_mask.count(0)
    assert r.text == calls[-1][1]["text"]
    # what the trainer will score is what was sampled: HF on the rollout's own ids, at the sampled positions
    ref = hf_logprobs(hf, r.prompt_ids + r.completion_ids)[len(r.prompt_ids) - 1:]
    sampled = torch.tensor(r.loss_mask, dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(r.behaviour_logprobs)[sampled], ref[sampled], atol=3e-3, rtol=1e-3)
    assert set(r.model_versions) == {gen.version}


class UpdateAfterFirstTurn(Echo):
    """Echo that pushes new weights while it answers the first turn (between two turns)."""

    def __init__(self, push, **kw):
        super().__init__(**kw)
        self.push = push

    def step(self, turn):
        result = super().step(turn)
        if self.k == 1:
            self.push()
        return result


def test_update_between_turns_prefills_under_the_new_weights(gen, tok, newline, hf):
    new = perturbed(hf, seed=3)
    old_version, version = gen.version, gen.version + 1
    sender = WeightSender(0, [target_of(gen)], bucket_mb=1.0)
    push = functools.partial(push_in_process, [gen], [(sender, named(new))],
                             version)
    try:
        r, calls, _ = play(gen, tok, newline, functools.partial(UpdateAfterFirstTurn, push, turns=2))
    finally:
        sender.close()
    model = [(a, b) for a, b, m in runs(r.loss_mask) if m]
    assert r.weight_versions[slice(*model[0])] == [old_version] * (model[0][1] - model[0][0])
    assert r.weight_versions[slice(*model[1])] == [version] * (model[1][1] - model[1][0])
    assert calls[1][1]["meta_info"]["cached_tokens"] == 0  # no KV of the old weights reused
    ids = r.prompt_ids + r.completion_ids
    lp = torch.tensor(r.behaviour_logprobs)
    n = len(r.prompt_ids) - 1
    for (a, b), model_ in zip(model, (hf, new)):  # each turn equals HF on the weights it was sampled with
        torch.testing.assert_close(lp[a:b], hf_logprobs(model_, ids)[n + a:n + b], atol=3e-3, rtol=1e-3)
    with pytest.raises(AssertionError):  # and the second turn is not the old weights' (the check has teeth)
        torch.testing.assert_close(lp[slice(*model[1])], hf_logprobs(hf, ids)[n + model[1][0]:n + model[1][1]],
                                   atol=3e-3, rtol=1e-3)


def test_a_failing_environment_fails_its_episode_not_the_generator(gen, tok, newline):
    made = []

    def make():
        made.append(Echo(turns=3, fail_at=2))
        return made[-1]

    r, calls, _ = play(gen, tok, newline, make)
    assert r.episode.stop == "env_error" and "EnvFailure" in r.episode.error and "scripted failure" in r.episode.error
    assert len(calls) == 2 and made[0].closed
    assert issubclass(EnvFailure, RuntimeError)


class SeesWaiting(Echo):
    """Echo that records, at each step, how many samples the generator counts in an environment step."""

    def __init__(self, gen, seen, **kw):
        super().__init__(**kw)
        self.gen, self.seen = gen, seen

    def step(self, turn):
        self.seen.append(self.gen.env_waiting)
        return super().step(turn)


def test_a_sample_between_turns_counts_as_waiting_on_its_environment(gen, tok, newline):
    """Generator.env_waiting (env.extra_in_flight's admission): 1 while the episode's environment steps,
    between its turns; 0 once it ended (play checks)."""
    seen = []
    r, calls, _ = play(gen, tok, newline, lambda: SeesWaiting(gen, seen, turns=3))
    assert len(calls) == 3 and seen == [1, 1, 1]


class KillServerAfterFirstTurn(Echo):
    """Echo that kills the generator's server while it answers the first turn."""

    def __init__(self, server, **kw):
        super().__init__(**kw)
        self.server, self.resets = server, 0

    def reset(self, task):
        self.resets += 1
        return super().reset(task)

    def step(self, turn):
        result = super().step(turn)
        if self.k == 1:
            self.server.kill_for_test()
        return result


def test_a_server_restart_resumes_the_episode_at_its_last_turn_boundary(gen, tok, newline, hf):
    made, incarnation, served = [], gen.incarnation, gen.version

    def make():
        made.append(KillServerAfterFirstTurn(gen.server, turns=2))
        return made[-1]

    r, calls, _ = play(gen, tok, newline, make)
    assert gen.incarnation == incarnation + 1 and len(made) == 1 and made[0].resets == 1  # one environment
    assert r.episode.turns == 2 and r.episode.stop == "done"
    model = [(a, b) for a, b, m in runs(r.loss_mask) if m]
    # the first turn was kept; the second ran on the relaunched server, from the same context
    assert calls[0][1]["output_ids"] == r.completion_ids[slice(*model[0])]
    assert calls[-1][0]["input_ids"] == r.prompt_ids + r.completion_ids[:model[1][0]]
    assert calls[-1][1]["output_ids"] == r.completion_ids[slice(*model[1])]
    # the first turn keeps the version it was sampled with; the relaunched server serves the disk weights
    # (version 0, = hf), and the second turn equals HF on them, conditioned on the episode's own ids
    (a0, b0), (a1, b1) = model
    assert r.weight_versions[a0:b0] == [served] * (b0 - a0) and r.weight_versions[a1:b1] == [0] * (b1 - a1)
    n = len(r.prompt_ids) - 1
    torch.testing.assert_close(torch.tensor(r.behaviour_logprobs[a1:b1]),
                               hf_logprobs(hf, r.prompt_ids + r.completion_ids)[n + a1:n + b1], atol=3e-3, rtol=1e-3)


class Forgetful(Echo):
    """Echo whose new instances answer a replayed turn differently (state the replay cannot rebuild)."""

    def step(self, turn):
        result = super().step(turn)
        for m in result.observation:
            m["content"] += f" ({id(self)})"
        return result


def test_an_episode_continued_from_its_boundary_samples_only_the_rest(gen, tok, newline):
    gen.record_boundaries = True
    try:
        first, _, _ = play(gen, tok, newline, functools.partial(Echo, turns=3))
        boundaries = gen.boundaries()
    finally:
        gen.record_boundaries = False
    assert [b.report.turns for b in boundaries] == [1, 2] and all(b.key == ("g", 0) for b in boundaries)
    b = boundaries[-1]
    assert first.prompt_ids == b.prompt_ids and first.completion_ids[:len(b.ids)] == b.ids
    r, calls, _ = play(gen, tok, newline, functools.partial(Echo, turns=3), resume=b)
    ((body, out),) = calls  # one turn left: one request, on exactly the recorded context
    assert body["input_ids"] == b.prompt_ids + b.ids
    n = len(b.ids)
    assert (r.completion_ids[:n], r.behaviour_logprobs[:n], r.weight_versions[:n]) == (b.ids, b.logprobs, b.versions)
    assert r.completion_ids[n:] == out["output_ids"] and r.loss_mask == b.mask + [1] * len(out["output_ids"])
    assert (r.episode.turns, r.episode.resumed_turns, r.episode.replay_diverged) == (3, 2, False)

    # an environment that cannot replay the recorded turns: the episode starts over, and says so
    r, calls, _ = play(gen, tok, newline, functools.partial(Forgetful, turns=3), resume=b)
    assert len(calls) == 3 and calls[0][0]["input_ids"] == r.prompt_ids
    assert (r.episode.turns, r.episode.resumed_turns, r.episode.replay_diverged) == (3, 0, True)
