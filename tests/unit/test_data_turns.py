"""Observation ids between an episode's turns equal what the model's chat template renders for the whole
conversation (the independent reference: `apply_chat_template` of every message at once), on the shipped
SmolLM2 template and on Qwen3's template (tests/fixtures/chat_templates/qwen3.jinja, which is not
append-only). The context is built as an episode builds it: prompt ids, then per turn the sampled ids
(content + stop token, never re-encoded) and the observation's ids."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from megatron_rl.data.prompts import get_template, render_prompt_ids
from megatron_rl.data.turns import ChatTurns, TemplateError
from megatron_rl.records import Problem

QWEN3 = (Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()

TURNS = [
    "Let me compute it.\n<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(123 * 456)\"}}\n</tool_call>",
    " Two calls now: é, 中文 and  spaces.\n\n",
    "The product is \\boxed{56088}.",
]
OBSERVATIONS = [
    [{"role": "tool", "content": "56088\n"}],
    [{"role": "tool", "content": "first"}, {"role": "tool", "content": "  second\n"}],
    [{"role": "user", "content": "And 2 * 3?"}],
]


@pytest.fixture(scope="module")
def smollm2():
    from megatron_rl.train.hf_source import resolve_model

    return resolve_model("smollm2-135m").tokenizer()


@pytest.fixture(scope="module")
def qwen3(smollm2):
    tok = copy.deepcopy(smollm2)  # SmolLM2's vocabulary has <|im_start|>/<|im_end|> as special tokens
    tok.chat_template = QWEN3
    return tok


def episode(tok, turns: ChatTurns, observations, stopped=True) -> tuple[list[int], list[dict]]:
    """(context ids as an episode grows them, the conversation's messages)."""
    problem = Problem("p", "What is 123 * 456?", {}, messages=[{"role": "system", "content": "Use tools."},
                                                               {"role": "user", "content": "What is 123 * 456?"}])
    ids = render_prompt_ids(tok, problem, turns.template)
    messages = [dict(m) for m in problem.messages]
    stop = list(turns.stop_ids[:1])
    for content, observation in zip(TURNS, observations):
        sampled = tok(content, add_special_tokens=False).input_ids + (stop if stopped else [])
        ids += sampled + turns.observation_ids(observation, turn_stopped=stopped)
        messages += [{"role": "assistant", "content": turns.template.assistant_prefix + content}, *observation]
    return ids, messages


def rendered(tok, messages, template) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                   **template.chat_template_kwargs) + template.assistant_prefix


@pytest.mark.parametrize("which", ["smollm2", "qwen3"])
@pytest.mark.parametrize("n_turns", [1, 3])
@pytest.mark.parametrize("stopped", [True, False])
def test_context_equals_the_render_of_the_whole_conversation(request, which, n_turns, stopped):
    tok = request.getfixturevalue(which)
    turns = ChatTurns(tok, get_template("none"))
    ids, messages = episode(tok, turns, OBSERVATIONS[:n_turns], stopped)
    assert ids == tok(rendered(tok, messages, turns.template), add_special_tokens=False).input_ids


def test_assistant_prefix_follows_every_observation(smollm2):
    template = dataclasses.replace(get_template("short"), system=None)
    turns = ChatTurns(smollm2, template)
    ids, messages = episode(smollm2, turns, OBSERVATIONS)
    # the prefix is part of each assistant message; compared as text, since "<think>\n" + content is one
    # BPE run in the whole render but two encodings in the episode (prompt side, then sampled)
    assert smollm2.decode(ids) == rendered(smollm2, messages, template)
    assert smollm2.decode(turns.observation_ids(OBSERVATIONS[0])).endswith("<|im_start|>assistant\n<think>\n")


def test_template_kwargs_shape_every_generation_prompt(qwen3):
    """Qwen3 without thinking opens each turn with an empty think block. The model samples after it, so
    the episode keeps it before every turn, although a render of the history would drop it again."""
    turns = ChatTurns(qwen3, get_template("none"))
    no_think = ChatTurns(qwen3, dataclasses.replace(turns.template, chat_template_kwargs={"enable_thinking": False}))
    tail = qwen3.decode(no_think.observation_ids(OBSERVATIONS[1]))
    assert tail == qwen3.decode(turns.observation_ids(OBSERVATIONS[1])) + "<think>\n\n</think>\n\n"
    assert tail.endswith("second\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_is_not_append_only_so_history_is_never_rendered_again(qwen3):
    """Why the context is grown, not re-rendered: the same assistant message renders differently once
    it is no longer the last one."""
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    before = qwen3.apply_chat_template(history, tokenize=False)
    after = qwen3.apply_chat_template(history + OBSERVATIONS[0], tokenize=False, add_generation_prompt=True)
    assert not after.startswith(before)


def test_rendering_the_observation_alone_is_wrong(smollm2):
    """The broken variant the delta avoids: the observation rendered on its own lacks the newline after
    the turn's end token and gains the template's default system prompt."""
    turns = ChatTurns(smollm2, get_template("none"))
    alone = smollm2.apply_chat_template(OBSERVATIONS[0], tokenize=True, add_generation_prompt=True)
    assert list(alone) != turns.observation_ids(OBSERVATIONS[0])
    ids, messages = episode(smollm2, turns, OBSERVATIONS[:1])
    assert ids == smollm2(rendered(smollm2, messages, turns.template), add_special_tokens=False).input_ids


def test_a_turn_cut_by_the_cap_gets_its_stop_token_as_an_environment_token(smollm2):
    turns = ChatTurns(smollm2, get_template("none"))
    closed, open_ = turns.observation_ids(OBSERVATIONS[0], True), turns.observation_ids(OBSERVATIONS[0], False)
    assert open_ == [smollm2.convert_tokens_to_ids("<|im_end|>")] + closed


def test_templates_that_cannot_continue_an_episode_are_refused(smollm2):
    tok = copy.deepcopy(smollm2)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\n<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="not with a stop token"):
        ChatTurns(tok, get_template("none")).observation_ids(OBSERVATIONS[0])
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                         "{{ m.content }}<|im_end|>{% endfor %}")
    with pytest.raises(TemplateError, match="cannot render an observation \\(tool\\).*no tools"):
        ChatTurns(tok, get_template("none")).observation_ids(OBSERVATIONS[0])
    tok.chat_template = None
    with pytest.raises(TemplateError, match="chat template"):
        ChatTurns(tok, get_template("none"))
