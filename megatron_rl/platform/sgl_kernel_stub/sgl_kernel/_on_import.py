"""Patching an SGLang module right after it is executed: the modules a stub fix changes are imported by
SGLang later than the stub (or were already), so each fix names which modules it patches and how."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, matches: Callable[[str], bool], patch: Callable) -> None:
        self.matches, self.patch = matches, patch

    def find_spec(self, name, path, target=None):
        if not self.matches(name):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def patch_on_import(matches: Callable[[str], bool], patch: Callable) -> None:
    """`patch(module)` for every module whose name `matches`: those imported already at once, the others
    right after they are executed. Installing the same `patch` twice does nothing more."""
    for name, module in list(sys.modules.items()):
        if matches(name):
            patch(module)
    if not any(isinstance(f, _PatchOnImport) and f.patch is patch for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(matches, patch))
