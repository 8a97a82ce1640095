"""Episodes as a run configures them (the `env` section): the prompt template the controller renders
prompts with (the environment's tool schemas in it, so the chat template describes the tools) and the
setup a generator rank plays episodes with. Both sides render with the same template: the prompt ids the
controller sends and the observation ids a generator appends come from one chat template."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from megatron_rl.config import Config
from megatron_rl.data.prompts import PromptTemplate, get_template
from megatron_rl.data.turns import ChatTurns, TemplateError
from megatron_rl.env import load_environment, make_environment, shared_slots
from megatron_rl.errors import InputError
from megatron_rl.rollout.episode import EpisodeLimits, EpisodeSetup


def prompt_template(cfg: Config) -> PromptTemplate:
    """The data's template, with `tools=` for the chat template when the environment offers tools."""
    template = get_template(cfg.data)
    tools = environment_tools(cfg)
    if not tools:
        return template
    return dataclasses.replace(template, chat_template_kwargs=template.chat_template_kwargs | {"tools": tools})


def environment_tools(cfg: Config) -> list[dict[str, Any]]:
    """The environment's tool schemas, read from one instance made with the run's arguments and closed:
    a class may set `tools` in its constructor (from its arguments) or as a dataclass field, which its
    class attribute would not show."""
    env = make_environment(cfg.env.name, environment_args(cfg))
    try:
        return list(getattr(env, "tools", None) or [])
    finally:
        env.close()


def environment_args(cfg: Config) -> dict[str, Any]:
    """The keyword arguments each environment is made with: env.args, and the run's reward config as
    `reward_config` for an environment whose constructor takes one (one that grades mid-episode as the
    reward will, e.g. python_tests)."""
    args = dict(cfg.env.args)
    try:
        takes = "reward_config" in inspect.signature(load_environment(cfg.env.name)).parameters
    except (TypeError, ValueError):  # no signature to read
        takes = False
    if takes:
        args["reward_config"] = cfg.reward
    return args


def episode_setup(cfg: Config, tokenizer) -> EpisodeSetup:
    """How a generator rank plays episodes: a new environment per episode (env.name, env.args), the caps,
    and observations rendered by the model's chat template (none for an environment without a template
    to render them: the single-turn task shows nothing). Sizes the rank's shared tool slots."""
    e = cfg.env
    if e.tool_concurrency is not None:
        shared_slots().resize(e.tool_concurrency)
    turns = ChatTurns(tokenizer, prompt_template(cfg)) if getattr(tokenizer, "chat_template", None) else None
    if e.multi_turn:  # an environment may answer a turn: the template must continue one, say so now
        try:
            if turns is None:
                raise TemplateError("the tokenizer has no chat template to render observations with")
            turns.observation_ids([{"role": "user", "content": "probe"}])
        except TemplateError as err:
            raise InputError(f"env.name: {e.name} plays multi-turn episodes, but {err}") from None
    return EpisodeSetup(make_env=functools.partial(make_environment, e.name, environment_args(cfg)),
                        limits=EpisodeLimits(e.max_turns, e.max_turn_tokens, e.max_observation_tokens,
                                                              e.episode_timeout_s), turns=turns)
