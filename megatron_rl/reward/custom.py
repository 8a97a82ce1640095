"""Reward plug-ins: `reward.custom` names a function that grades a response in place of the built-in
reward (as verl's `custom_reward_function` and slime's `--custom-rm-path` do). Three forms:

- ``"my_pkg.rewards:exact_match"``: a module importable on every rank, and its function;
- ``"path/to/rewards.py:exact_match"``: a Python file (relative paths from the working directory);
- ``"exact_match"``: an entry point of the group ``megatron_rl.rewards`` of an installed package
  (``[project.entry-points."megatron_rl.rewards"] exact_match = "my_pkg.rewards:exact_match"``).

The function is called as ``fn(task, response, ctx) -> RewardBreakdown``:
``task`` is the problem's task dict (``kind``, ``answer`` or ``tests``/``language``, ``problem``,
``id``, ``source`` and ``meta``: the data loader puts a row's other columns there); ``response`` is
the completion text (with the template's assistant prefix); ``ctx`` is a :class:`RewardContext`
(the reward config, the response length in tokens and its overlong-penalty window, and
``ctx.builtin()``: the built-in reward of this response, to add to or adjust rather than replace).
The returned :class:`RewardBreakdown` is checked (types, finite numbers, a known status); anything
else is an error naming ``reward.custom``. The plug-in runs where ``reward.score`` runs: in the
verifier pool's worker processes, under ``reward.verifier_item_timeout_s`` and the same crash and
hang handling as the built-in verifiers (a hung plug-in gets status "timeout", a raising one
"error", a dying one is re-issued, then "crash"; none of them is trained on).
"""
from __future__ import annotations

import functools
import inspect
import math
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from megatron_rl.plugins import PluginNotFound, find
from megatron_rl.reward.types import GradeStatus, RewardBreakdown

if TYPE_CHECKING:
    from megatron_rl.config import RewardConfig

ENTRY_POINT_GROUP = "megatron_rl.rewards"
_STATUSES = tuple(GradeStatus)


class RewardPluginError(ValueError):
    """`reward.custom` cannot be loaded, or its function returned something that is no reward."""


@dataclass(frozen=True)
class RewardContext:
    """What a plug-in gets besides the task and the response."""

    config: "RewardConfig"
    num_tokens: int  # response length in tokens (estimated from characters when num_tokens_estimated)
    num_tokens_estimated: bool
    l_max: int  # the overlong-penalty window in force for this response (its length stage's)
    l_cache: int
    task: dict[str, Any]

    def builtin(self, response: str) -> RewardBreakdown:
        """The built-in reward (format gate, correctness, overlong penalty, language) of `response`."""
        from megatron_rl.reward.compose import builtin_score

        return builtin_score(self.task, response, self.config,
                             None if self.num_tokens_estimated else self.num_tokens,
                             l_max=self.l_max, l_cache=self.l_cache)


@functools.lru_cache(maxsize=None)
def load_reward_fn(spec: str) -> Callable:
    """The plug-in function of `spec` (cached per process); RewardPluginError naming reward.custom."""
    try:
        fn = find(spec, ENTRY_POINT_GROUP, "function")
    except PluginNotFound as e:
        hint = "" if ":" in spec else "; use 'module:function' or 'file.py:function'"
        raise RewardPluginError(f"reward.custom {spec!r}: {e}{hint}") from None
    except Exception as e:  # ImportError, SyntaxError, or whatever the plug-in's import raised
        raise RewardPluginError(f"reward.custom {spec!r}: cannot load it: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise RewardPluginError(f"reward.custom {spec!r}: {type(fn).__name__} is not callable")
    try:
        inspect.signature(fn).bind(None, "", None)
    except TypeError:
        raise RewardPluginError(f"reward.custom {spec!r}: must take (task, response, ctx)") from None
    except ValueError:  # builtins without a signature: call and see
        pass
    return fn


def plugin_error(spec: str) -> str | None:
    """Why `spec` cannot be used as reward.custom (None: it loads). For config validation."""
    try:
        load_reward_fn(spec)
    except RewardPluginError as e:
        return str(e).removeprefix(f"reward.custom {spec!r}: ")
    return None


def _checked(spec: str, out: Any) -> RewardBreakdown:
    def bad(why: str) -> RewardPluginError:
        return RewardPluginError(f"reward.custom {spec!r} returned {why}; expected a "
                                 f"megatron_rl.reward.RewardBreakdown (docs/reward.md, 'Add a verifier')")

    if not isinstance(out, RewardBreakdown):
        raise bad(f"a {type(out).__name__}")
    for name in ("format_ok", "correct"):
        if not isinstance(getattr(out, name), bool):
            raise bad(f"{name}={getattr(out, name)!r} (not a bool)")
    if out.language_ok is not None and not isinstance(out.language_ok, bool):  # None: not checked
        raise bad(f"language_ok={out.language_ok!r} (not a bool or None)")
    for name in ("total", "length_penalty"):
        value = getattr(out, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(f"{name}={value!r} (not a finite number)")
        setattr(out, name, float(value))
    if out.status not in _STATUSES:  # set after construction (RewardBreakdown checks it when built)
        raise bad(f"status={out.status!r} (known: {', '.join(_STATUSES)})")
    out.status = GradeStatus(out.status)
    if not isinstance(out.details, dict):
        raise bad(f"details of type {type(out.details).__name__} (not a dict)")
    return out


def _raised(spec: str, e: Exception) -> RewardPluginError:
    """The plug-in's own exception, naming reward.custom and the line that raised it: the verifier
    pool keeps only this one line (status "error"), so it must lead the user to the bug."""
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return RewardPluginError(f"reward.custom {spec!r} raised {type(e).__name__}: {e} "
                             f"({Path(frame.filename).name}:{frame.lineno} in {frame.name})")


def custom_score(spec: str, task: dict[str, Any], response: str, ctx: RewardContext) -> RewardBreakdown:
    """Grade with the plug-in of `spec` and check what it returned."""
    fn = load_reward_fn(spec)
    try:
        returned = fn(dict(task), response, ctx)
    except Exception as e:
        raise _raised(spec, e) from e
    out = _checked(spec, returned)
    out.num_tokens, out.num_tokens_estimated = ctx.num_tokens, ctx.num_tokens_estimated
    out.details.setdefault("reward", f"custom:{spec}")
    return out
