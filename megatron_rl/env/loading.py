"""Finding an environment class by name, as ``reward.custom`` finds a reward function. Four forms:

- ``"python"``, ``"python_tests"``, ``"single_turn"``, ``"echo"``: the built-ins (:data:`BUILTINS`);
- ``"my_pkg.envs:Calculator"``: a module importable on every generator rank, and its class;
- ``"path/to/envs.py:Calculator"``: a Python file (relative paths from the working directory);
- ``"calculator"``: an entry point of the group ``megatron_rl.environments`` of an installed package
  (``[project.entry-points."megatron_rl.environments"] calculator = "my_pkg.envs:Calculator"``).

What loads is a class with ``reset``, ``step`` and ``close``, plain ``def`` (subclassing
:class:`megatron_rl.env.base.Environment` is optional); a file may import modules next to it
(``plugins.load_file``). Anything else is an :class:`EnvLoadError`
with a one-line message that starts with the config key the caller names (``key``, e.g.
``"env.name"``), so the user knows which setting to fix. Files are loaded with ``reward.custom``'s
helper (one loader for every plug-in).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from megatron_rl.env.base import Environment
from megatron_rl.env.python_tests import PythonTests
from megatron_rl.env.python_tool import PythonTool
from megatron_rl.env.scripted import Echo
from megatron_rl.env.single_turn import SingleTurn
from megatron_rl.plugins import PluginNotFound, find

ENTRY_POINT_GROUP = "megatron_rl.environments"
BUILTINS: dict[str, type] = {"python": PythonTool, "python_tests": PythonTests, "single_turn": SingleTurn,
                             "echo": Echo}
_METHODS = ("reset", "step", "close")


class EnvLoadError(ValueError):
    """An environment cannot be loaded or made; the message names the config key and is one line."""


class _Why(Exception):
    """Why a spec does not load, without the key (added by the public functions)."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@functools.lru_cache(maxsize=None)
def _load(spec: str) -> type:
    try:
        obj = BUILTINS.get(spec.strip()) or find(spec, ENTRY_POINT_GROUP, "class")
    except PluginNotFound as e:
        builtins = f"no built-in {spec.strip()!r} ({', '.join(sorted(BUILTINS))}) and " if ":" not in spec else ""
        hint = "; use 'module:Class' or 'file.py:Class'" if ":" not in spec else ""
        raise _Why(f"{builtins}{e}{hint}") from None
    except Exception as e:  # ImportError, SyntaxError, or whatever the module's import raised
        raise _Why(f"cannot load it: {type(e).__name__}: {e}") from None
    if not inspect.isclass(obj):
        raise _Why(f"is not an environment: a {type(obj).__name__}, not a class with "
                   f"{', '.join(_METHODS)} (megatron_rl.env.base.Environment)")
    missing = [m for m in _METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise _Why(f"is not an environment: class {obj.__name__} has no {', '.join(missing)} "
                   f"(see megatron_rl.env.base.Environment)")
    if issubclass(obj, Environment) and any(getattr(obj, m) is getattr(Environment, m) for m in ("reset", "step")):
        raise _Why(f"is not an environment: class {obj.__name__} does not implement reset and step")
    asynchronous = [m for m in _METHODS if inspect.iscoroutinefunction(getattr(obj, m))]
    if asynchronous:  # its calls would return coroutines nobody awaits (the contract is synchronous)
        raise _Why(f"is not an environment: class {obj.__name__} has async {', '.join(asynchronous)}; environments "
                   f"are synchronous (def, not async def: each episode runs in its own thread)")
    return obj


def load_environment(spec: str, key: str = "env.name") -> type:
    """The environment class ``spec`` names (cached per process); EnvLoadError naming ``key``."""
    if not isinstance(spec, str) or not spec.strip():
        raise EnvLoadError(f"{key}: expected an environment name, 'module:Class' or 'file.py:Class', got {spec!r}")
    try:
        return _load(spec)
    except _Why as e:
        raise EnvLoadError(_one_line(f"{key}: {spec!r} {e}" if str(e).startswith("is not")
                                     else f"{key}: {spec!r}: {e}")) from None


def make_environment(spec: str, kwargs: dict[str, Any] | None = None, key: str = "env.name",
                     args_key: str = "env.args") -> Any:
    """A new environment of ``spec`` made with ``kwargs`` (one per episode). Arguments the class does
    not take (or lacks) are an EnvLoadError naming ``args_key``, ``tools`` that are no list of schemas
    one naming ``key``; what its constructor raises propagates."""
    cls = load_environment(spec, key)
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        what = "needs more than" if str(e).startswith("missing") else "does not take"
        raise EnvLoadError(_one_line(f"{args_key}: {spec!r} {what} {sorted(kwargs)}: {e}")) from None
    except ValueError:  # no signature to read: let the call decide
        pass
    env = cls(**kwargs)
    why = _tools_error(getattr(env, "tools", None))
    if why is not None:
        env.close()
        raise EnvLoadError(_one_line(f"{key}: {spec!r}: {why}"))
    return env


def _tools_error(tools: Any) -> str | None:
    """Why an environment's ``tools`` cannot go to ``apply_chat_template(tools=...)``, or None. Read
    from an instance: a constructor or a dataclass field may set them."""
    if tools is None or (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
        return None
    return (f"tools must be a list of tool schemas (dicts in the OpenAI function format), "
            f"got {tools!r:.100}")


def environment_error(spec: str, key: str = "env.name") -> str | None:
    """Why ``spec`` cannot be loaded (the EnvLoadError's line), or None. For config validation."""
    try:
        load_environment(spec, key)
    except EnvLoadError as e:
        return str(e)
    return None
