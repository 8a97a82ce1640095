"""megatron_rl.env.loading: environments by built-in name, 'module:Class', 'file.py:Class' or entry
point; every failure is one line that starts with the config key the caller names."""
from __future__ import annotations

import re
import textwrap

import pytest

from megatron_rl.env import (
    ENTRY_POINT_GROUP, Echo, EnvLoadError, PythonTool, SingleTurn, environment_error, load_environment,
    make_environment,
)
from megatron_rl.env import loading

COUNTDOWN = textwrap.dedent('''
    class Countdown:  # duck-typed: no base class needed
        def __init__(self, start=3):
            self.left = start

        def reset(self, task):
            return [{"role": "user", "content": f"{self.left} left"}]

        def step(self, turn):
            from megatron_rl.env import StepResult
            self.left -= 1
            if self.left:
                return StepResult([{"role": "user", "content": f"{self.left} left"}])
            return StepResult(done=True, reward=1.0)

        def close(self):
            pass
''')


@pytest.fixture(autouse=True)
def _fresh_cache():
    loading._load.cache_clear()
    yield
    loading._load.cache_clear()


def test_builtins_and_module_form():
    assert load_environment("python") is PythonTool
    assert load_environment("single_turn") is SingleTurn
    assert load_environment(" echo ") is Echo
    assert load_environment("megatron_rl.env.scripted:Echo") is Echo
    env = make_environment("megatron_rl.env.scripted:Echo", {"turns": 3})
    assert isinstance(env, Echo) and env.turns == 3
    assert environment_error("echo") is None


def _play(env) -> list:
    seen = [env.reset({})]
    while True:
        result = env.step("ok")
        seen.append(result.observation)
        if result.done:
            env.close()
            return seen + [result.reward]


def test_file_form_relative_and_absolute(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(COUNTDOWN)
    monkeypatch.chdir(tmp_path)  # a relative path starts at the working directory
    cls = load_environment("my_envs.py:Countdown")
    assert cls.__name__ == "Countdown"
    assert _play(make_environment("my_envs.py:Countdown", {"start": 2})) == [
        [{"role": "user", "content": "2 left"}], [{"role": "user", "content": "1 left"}], [], 1.0]
    assert load_environment(f"{tmp_path}/my_envs.py:Countdown").__name__ == "Countdown"


def test_entry_point_form(tmp_path, monkeypatch):
    (tmp_path / "my_envs_pkg.py").write_text(COUNTDOWN)
    dist = tmp_path / "my_envs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ncountdown = my_envs_pkg:Countdown\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = load_environment("countdown")
    assert cls.__module__ == "my_envs_pkg" and cls.__name__ == "Countdown"
    assert _play(cls(start=1)) == [[{"role": "user", "content": "1 left"}], [], 1.0]
    with pytest.raises(EnvLoadError, match=r"installed: countdown\)"):
        load_environment("countup")


ERRORS = {
    "no_such_module_xyz:Env": "cannot load it: ModuleNotFoundError: No module named 'no_such_module_xyz'",
    "megatron_rl.env.scripted:Nope": "megatron_rl.env.scripted has no class 'Nope'",
    "missing_envs.py:Env": "file 'missing_envs.py' not found",
    "broken_envs.py:Env": "cannot load it: RuntimeError: boom at import",
    "collections:OrderedDict": "is not an environment: class OrderedDict has no reset, step, close",
    "megatron_rl.env.loading:load_environment": "is not an environment: a function, not a class",
    "megatron_rl.env.base:Environment": "is not an environment: class Environment does not implement reset and step",
    "no_such_env": f"no built-in 'no_such_env' (echo, python, python_tests, single_turn) and no entry point "
                   f"'no_such_env' in group {ENTRY_POINT_GROUP}",
}


@pytest.mark.parametrize("spec", sorted(ERRORS))
def test_load_errors_are_one_line_naming_the_key(spec, tmp_path, monkeypatch):
    (tmp_path / "broken_envs.py").write_text("raise RuntimeError('boom\\nat import')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EnvLoadError) as info:
        load_environment(spec, key="env.my_key")
    message = str(info.value)
    assert message.startswith(f"env.my_key: {spec!r}"), message
    assert ERRORS[spec] in message, message
    assert "\n" not in message
    assert environment_error(spec, key="env.my_key") == message  # for config validation


def test_empty_name_and_arguments_the_class_does_not_take():
    with pytest.raises(EnvLoadError, match=r"^env\.name: expected an environment name"):
        load_environment("  ")
    with pytest.raises(EnvLoadError, match=re.escape("env.args: 'echo' does not take ['colour']")):
        make_environment("echo", {"colour": "red"})
    with pytest.raises(ValueError, match="turns must be an int >= 1"):  # the constructor's own check
        make_environment("echo", {"turns": 0})


def test_file_form_with_a_dataclass(tmp_path):
    (tmp_path / "dc_envs.py").write_text(textwrap.dedent('''
        from __future__ import annotations
        from dataclasses import dataclass
        from megatron_rl.env import Environment, StepResult

        @dataclass
        class Once(Environment):
            reward: float = 1.0

            def reset(self, task):
                return []

            def step(self, turn):
                return StepResult(done=True, reward=self.reward)
    '''))
    assert load_environment(f"{tmp_path}/dc_envs.py:Once")().reward == 1.0


def test_a_file_imports_modules_next_to_it(tmp_path, monkeypatch):
    """As under `python file.py`: the file's folder is on sys.path while it imports (from any working
    directory), and only then."""
    import sys

    folder = tmp_path / "my envs"
    folder.mkdir()
    (folder / "sibling_helper_xyz.py").write_text("INTRO = 'from the helper'\n")
    (folder / "game.py").write_text("from sibling_helper_xyz import INTRO\n" + COUNTDOWN.replace(
        'f"{self.left} left"}]\n\n    def step', 'INTRO}]\n\n    def step', 1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delitem(sys.modules, "sibling_helper_xyz", raising=False)
    env = make_environment("../my envs/game.py:Countdown", {"start": 1})
    assert env.reset({}) == [{"role": "user", "content": "from the helper"}]
    assert str(folder) not in sys.path


def test_async_methods_are_refused_when_loaded(tmp_path):
    """An `async def step` would return a coroutine nobody awaits: refused in one line, before any episode."""
    (tmp_path / "async_envs.py").write_text(COUNTDOWN.replace("def step", "async def step"))
    with pytest.raises(EnvLoadError, match=r"^env\.name: .* class Countdown has async step; environments are "
                                           r"synchronous"):
        load_environment(f"{tmp_path}/async_envs.py:Countdown")


def test_a_missing_constructor_argument_is_named(tmp_path):
    (tmp_path / "needy_envs.py").write_text(COUNTDOWN.replace("start=3", "start"))
    with pytest.raises(EnvLoadError, match=re.escape("env.args: ") + r".*needs more than \[\]: missing a required "
                                           r"argument: 'start'"):
        make_environment(f"{tmp_path}/needy_envs.py:Countdown", {})


@pytest.mark.parametrize("tools", ["{'type': 'function'}", "['calc']", "'calc'"])
def test_tools_that_are_no_list_of_schemas_are_refused_naming_env_name(tmp_path, tools):
    """The instance's tools (a constructor may set them) go to apply_chat_template(tools=...): one schema
    instead of a list, or names, would render garbage or nothing."""
    source = COUNTDOWN.replace("self.left = start", f"self.left, self.tools = start, {tools}")
    (tmp_path / "tool_envs.py").write_text(source)
    with pytest.raises(EnvLoadError, match=r"^env\.name: .*tools must be a list of tool schemas"):
        make_environment(f"{tmp_path}/tool_envs.py:Countdown")


def test_preflight_names_close_not_the_arguments_when_close_raises(tmp_path):
    """The run's check makes and closes one environment: a close() that raises is named as such (every
    episode would end that way), not blamed on env.args."""
    from megatron_rl.config import ConfigError, config_from_dict
    from megatron_rl.control.preflight import check_config

    (tmp_path / "closing_envs.py").write_text(COUNTDOWN.replace("def close(self):\n        pass",
                                                                "def close(self):\n        raise OSError('gone')"))
    cfg = config_from_dict({"env": {"name": f"{tmp_path}/closing_envs.py:Countdown", "args": {"start": 2}}})
    with pytest.raises(ConfigError, match=r"^env\.name: .*close\(\) of an environment never reset raised OSError: gone"):
        check_config(cfg)
