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


def test_tools_an_environment_sets_in_its_constructor_reach_the_chat_template(tmp_path):
    """Read from an instance made with env.args: a constructor (or a dataclass field) may set them,
    which the class alone would not show."""
    (tmp_path / "calc_envs.py").write_text(
        "from dataclasses import dataclass, field\n"
        "from megatron_rl.env import Environment, StepResult\n"
        "def schema(name):\n"
        "    return {'type': 'function', 'function': {'name': name, 'parameters': {'type': 'object'}}}\n"
        "class Calc(Environment):\n"
        "    def __init__(self, ops=('add',)):\n"
        "        self.tools = [schema(op) for op in ops]\n"
        "    def reset(self, task):\n"
        "        return []\n"
        "    def step(self, turn):\n"
        "        return StepResult(done=True)\n"
        "@dataclass\n"
        "class Field(Environment):\n"
        "    tools: list = field(default_factory=lambda: [schema('look')])\n"
        "    def reset(self, task):\n"
        "        return []\n"
        "    def step(self, turn):\n"
        "        return StepResult(done=True)\n")
    cfg = config_from_dict({"env": {"name": f"{tmp_path}/calc_envs.py:Calc", "args": {"ops": ["add", "mul"]}}})
    tools = prompt_template(cfg).chat_template_kwargs["tools"]
    assert [t["function"]["name"] for t in tools] == ["add", "mul"]
    cfg = config_from_dict({"env": {"name": f"{tmp_path}/calc_envs.py:Field"}})
    assert [t["function"]["name"] for t in prompt_template(cfg).chat_template_kwargs["tools"]] == ["look"]


def test_a_template_that_cannot_continue_an_episode_is_refused_naming_env_name(tiny_tok):
    episode_setup(config_from_dict({}), tiny_tok)  # one turn: no observation to render, any template
    with pytest.raises(InputError, match=r"^env.name: echo plays multi-turn episodes, but .*not with a stop token"):
        episode_setup(config_from_dict({"env": {"name": "echo"}}), tiny_tok)
    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    setup = episode_setup(config_from_dict({"env": {"name": "echo", "max_turns": 3}}), tok)
    assert setup.limits.max_turns == 3 and setup.turns is not None and setup.make_env().turns == 2


# ---------------------------------------------------------------- episodes in flight across a resume
def _controller(tmp_path, generators=1):
    from megatron_rl.control.controller import Controller
    from megatron_rl.plan.layout import RankLayout
    from megatron_rl.records import Problem
    from support.control import CharTokenizer, PickleComm

    cfg = config_from_dict({"rollout": {"group_size": 2, "n_async": 4, "n_batch": 4, "n_mini": 1},
                            "env": {"name": "echo", "args": {"turns": 3}}, "run": {"output_dir": str(tmp_path)},
                            "data": {"source": "jsonl", "path": "unused"}})
    comm = PickleComm()
    problems = [Problem(f"p{i}", f"question {i}", {"kind": "math", "answer": "1"}) for i in range(5)]
    return Controller(comm, cfg, RankLayout(1, generators, 0), tmp_path, problems, CharTokenizer()), comm


def _boundary(group, index, turns):
    from megatron_rl.records import EpisodeReport, PartialEpisode

    n = 3 * turns
    return PartialEpisode(group.group_id, index, group.prompt_ids + [9], [5] * n, [-0.5] * n, [0] * n, [1, 1, 0] * turns,
                          [f"turn {k}" for k in range(turns)], [[{"role": "user", "content": "echo"}]] * turns,
                          EpisodeReport(turns=turns), elapsed_s=1.5)


def test_a_checkpoint_holds_each_episodes_last_boundary_and_a_resume_continues_it(tmp_path):
    import json

    from megatron_rl.control.protocol import Loaded, RolloutsReport, Tag
    from megatron_rl.records import Rollout

    ctrl, comm = _controller(tmp_path)
    ctrl.flow.fill()
    gen = ctrl.layout.generator_ranks[0]
    (first, second) = [g for _, r in comm.take(Tag.GENERATE) for g in r.groups]
    assert first.task == {"kind": "math", "answer": "1"} and not first.resume
    early, late, other = _boundary(first, 0, 1), _boundary(first, 0, 2), _boundary(second, 1, 1)
    ctrl._dispatch(gen, RolloutsReport([], 0.0, 0.0, [early, other]))
    ctrl._dispatch(gen, RolloutsReport([], 0.0, 0.0, [late]))
    ctrl._dispatch(gen + 1, RolloutsReport([], 0.0, 0.0, [_boundary(first, 1, 3)]))  # not its sample: ignored
    # a sample that came back needs no boundary any more (its rollout is graded, or issued whole again)
    done = Rollout(second.group_id, 1, second.prompt_ids, [5, 6], [-0.1, -0.2], [0, 0], "stop", stage=second.stage)
    ctrl._dispatch(gen, RolloutsReport([done], 0.0, 0.0))
    state = json.loads(json.dumps(ctrl.state_dict()))  # as the checkpoint holds it
    assert [(e["group_id"], e["sample_index"], e["report"]["turns"]) for e in state["episodes"]] == \
        [(first.group_id, 0, 2)]
    ctrl.shutdown()

    again, comm = _controller(tmp_path)
    again.mailbox.await_reply = lambda kind, timeout_s, on_failure=None: Loaded({"controller": state})
    again.resume(tmp_path / "checkpoints")
    reissued = {g.group_id: g for _, r in comm.take(Tag.GENERATE) for g in r.groups}
    assert reissued[first.group_id].resume == {0: late}  # the last boundary, as it was reported
    assert not reissued[second.group_id].resume  # sample 1 came back before the checkpoint: issued whole
    again.shutdown()


def test_a_lost_generators_episodes_continue_on_a_live_one_from_their_last_boundary(tmp_path):
    from megatron_rl.control.protocol import RolloutsReport, Tag, WorkerFailure

    ctrl, comm = _controller(tmp_path, generators=2)
    ctrl.flow.fill()
    sent = [(rank, g) for rank, r in comm.take(Tag.GENERATE) for g in r.groups]
    dead, group = sent[0]
    b = _boundary(group, 1, 2)
    ctrl._dispatch(dead, RolloutsReport([], 0.0, 0.0, [b]))
    ctrl._dispatch(dead, WorkerFailure("generator", dead, "server died", fatal=False))
    ((live, request),) = comm.take(Tag.GENERATE)
    (again,) = [g for g in request.groups if g.group_id == group.group_id]
    assert live != dead and again.resume == {1: b}
    ctrl.shutdown()
