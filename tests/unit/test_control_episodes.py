"""How a run configures episodes (control/episodes.py): the environment's tools reach the prompt
template, and a generator rank refuses, in one line naming env.name, a multi-turn environment whose
model's chat template cannot continue an episode (its turn does not end with a stop token)."""
from __future__ import annotations

import copy

import pytest

from megatron_rl.config import config_from_dict
from megatron_rl.control.episodes import episode_setup, prompt_template
from megatron_rl.env import PYTHON_TOOL
from megatron_rl.errors import InputError


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_the_environments_tools_reach_the_chat_template():
    assert "tools" not in prompt_template(config_from_dict({})).chat_template_kwargs
    tools = prompt_template(config_from_dict({"env": {"name": "python"}})).chat_template_kwargs["tools"]
    assert tools == [PYTHON_TOOL]


def test_a_template_that_cannot_continue_an_episode_is_refused_naming_env_name(tiny_tok):
    episode_setup(config_from_dict({}), tiny_tok)  # one turn: no observation to render, any template
    with pytest.raises(InputError, match=r"^env.name: echo plays multi-turn episodes, but .*not with a stop token"):
        episode_setup(config_from_dict({"env": {"name": "echo"}}), tiny_tok)
    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    setup = episode_setup(config_from_dict({"env": {"name": "echo", "max_turns": 3}}), tok)
    assert setup.limits.max_turns == 3 and setup.turns is not None and setup.make_env().turns == 2
