"""Where a plug-in comes from, for every kind of plug-in (reward functions, environments): a spec is
"module:name", "path/to/file.py:name" or an entry point's name in the kind's group. What the object
must be is the caller's check; this module only finds it."""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any


class PluginNotFound(ValueError):
    """The spec names nothing loadable; the message says why (the caller adds its config key)."""


def find(spec: str, group: str, what: str = "object") -> Any:
    """The object `spec` names. Errors raised by the plug-in's own import propagate as they are (the
    caller reports them as 'cannot load it'); PluginNotFound when the spec names nothing."""
    if ":" not in spec:
        return entry_point(group, spec.strip())
    where, name = (part.strip() for part in spec.rsplit(":", 1))
    is_file = where.endswith(".py") or "/" in where
    module = load_file(where) if is_file else importlib.import_module(where)
    if not hasattr(module, name):
        raise PluginNotFound(f"{where} has no {what} {name!r}")
    return getattr(module, name)


def entry_point(group: str, name: str) -> Any:
    found = importlib.metadata.entry_points(group=group)
    for ep in found:
        if ep.name == name:
            return ep.load()
    installed = sorted({ep.name for ep in found})
    raise PluginNotFound(f"no entry point {name!r} in group {group} (installed: {', '.join(installed) or 'none'})")


def load_file(path_text: str) -> Any:
    """The module of a Python file, registered in sys.modules under a name derived from its path:
    dataclasses and pickling look a class's module up there."""
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise PluginNotFound(f"file {path_text!r} not found (relative paths start at {Path.cwd()})")
    name = "megatron_rl_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginNotFound(f"{path_text!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # its folder leads sys.path while it runs, as under `python file.py`, so it may import modules next
    # to it (helpers.py); only then, so the folder's other files shadow nothing for the rest of the process
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module
