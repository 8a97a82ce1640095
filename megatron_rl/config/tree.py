"""Typed trees of dataclasses built from plain data (YAML), with errors that name the dotted key.

`build(cls, data, prefix)` checks every value against the field annotations (Literal, unions, lists,
mappings of str keys, bool/int/float/str, nested dataclasses); unknown keys and wrong types raise `ConfigError`.
`apply_override(root, tree, "a.b=value")` applies a dotted command-line override to the plain tree.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

import yaml

from megatron_rl.errors import InputError


class ConfigError(InputError, ValueError):
    """A config key is unknown, has the wrong type, or an invalid value."""


def check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check `value` against a (resolved) type annotation; ints are accepted where floats are. `Any`
    takes any YAML value: what it must be is checked where it is used (e.g. env.args by the environment
    pre-flight makes)."""
    if annotation is Any:
        return value
    origin = typing.get_origin(annotation)
    if origin is Literal:
        check(value in typing.get_args(annotation), key,
               f"must be one of {list(typing.get_args(annotation))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None:
            check(type(None) in args, key, "must not be null")
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is list:
        check(isinstance(value, list), key, f"must be a list, got {type(value).__name__}")
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # a mapping of named scalars (e.g. keyword arguments passed on to a library)
        check(isinstance(value, dict), key, f"must be a mapping, got {type(value).__name__}")
        _, item = typing.get_args(annotation)
        for k in value:
            check(isinstance(k, str), f"{key}.{k}", "mapping keys must be strings")
        return {k: _coerce(v, item, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(annotation):
        return build(annotation, value, key)
    if annotation is bool:
        check(isinstance(value, bool), key, f"must be true or false, got {value!r}")
        return value
    if annotation is int:
        check(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-6` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        check(ok, key, f"must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond the float range
            raise ConfigError(f"{key}: must be a finite number, got an integer beyond the float range") from None
        # no float key has a meaning for inf or nan (nan also slips through every range check)
        check(math.isfinite(number), key, f"must be a finite number, got {value!r}")
        return number
    if annotation is str:
        check(isinstance(value, str), key, f"must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported annotation {annotation!r}")


def build(cls: type, data: Any, prefix: str) -> Any:
    """An instance of dataclass `cls` from a mapping; nested dataclasses recurse, `prefix` names the place."""
    where = prefix or "config"
    check(isinstance(data, dict), where, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(f"{key}: unknown key (known: {', '.join(sorted(names))})")
        kwargs[k] = _coerce(v, hints[k], key)
    return cls(**kwargs)


def _is_mapping(annotation: Any) -> bool:
    return typing.get_origin(annotation) is dict or annotation in (dict, Any)


def apply_override(root: type, tree: dict, override: str) -> None:
    """Set `dotted.key=value` (a YAML value) in the plain `tree` of dataclass `root`, checking the path."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted.key=value")
    dotted, raw = (part.strip() for part in override.split("=", 1))
    parts = dotted.split(".")
    cls: Any = root
    node = tree
    for depth, name in enumerate(parts):
        key = ".".join(parts[:depth + 1])
        if _is_mapping(cls) and depth == len(parts) - 1:  # one entry of a mapping key (env.args.turns=3)
            break
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{key}: {'.'.join(parts[:depth])} is not a section")
        hints = typing.get_type_hints(cls)
        if name not in hints:  # named with the override: a section typo is no key of the YAML file
            raise ConfigError(f"{key}: unknown key in override {override!r} (known: {', '.join(sorted(hints))})")
        cls = hints[name]
        if depth < len(parts) - 1:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: must be a mapping")
    if dataclasses.is_dataclass(cls):
        raise ConfigError(f"{dotted}: is a section; override one of its keys")
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw else None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer of more digits than int() takes
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{dotted}: cannot parse value {raw!r}: {problem}") from None
