"""The layers of the house hold: no import cycle anywhere in megatron_rl/, and arrows only go downhill.

The import graph comes from the AST of every .py file under megatron_rl/ (nothing is imported). An edge
A -> B is counted for every `import` / `from ... import` statement anywhere in A: at module level, inside
functions and methods, and under `if TYPE_CHECKING:`. Function-level imports count because they are
still a dependency, only deferred: they are the usual way a cycle is hidden rather than removed, and a
deferred import of a heavy layer (Megatron in a verifier) costs the same when it runs. TYPE_CHECKING
imports count because they are arrows of the design all the same (a config section naming a reward type
ties the two layers together). Imports by string (`importlib.import_module(cfg.plugin)`) are not arrows:
they are how plug-ins are loaded, and pre-flight checks them.

An edge goes to the most specific module the statement names: `from megatron_rl.reward import math` is
an edge to `megatron_rl.reward.math` when that is a module, to `megatron_rl.reward` (its __init__)
when `math` is a name defined there. The implicit import of parent packages is not an edge (otherwise a
package __init__ that re-exports its submodules would close a cycle with every submodule).

The stated order (`LAYER_RULES`, `ONLY_THIRD_PARTY`, `NO_THIRD_PARTY`), by component (the first name
under megatron_rl: `config`, `reward`, `train`, ...):
- bottom: `errors` and `log` import nothing of ours; `config` imports only those two, and `records`
  those and `config` (a rollout carries its typed `LengthStage`);
- `algo` imports nothing of ours but algo, and no third-party library but torch;
- `algo` <- `ops` <- `train`: algo imports neither ops nor train, ops does not import train;
- `rollout` <- `sync` <- `control`: rollout does not import sync, sync does not import control (the
  weight update talks through a transport it defines; control's mailbox is one);
- `reward` imports neither `control` nor `train`, and nothing it reaches (transitively, through our
  modules) imports Megatron or SGLang: a verifier process must not load either;
- `plan` (placement, estimates, the simulator: offline) does not import `control` (the runtime ranks);
- `cli` is the top: nothing of ours outside it imports it (the root tools/ scripts are outside the
  package), and only it imports argparse: every command line is parsed there, the code it calls takes
  typed parameters.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_rl"

BOTTOM = {"errors", "log"}
# component -> the components of ours it may import (besides itself); components not named are free
# apart from FORBIDDEN.
ALLOWED = {
    "errors": set(),
    "log": set(),
    "config": BOTTOM,
    "records": BOTTOM | {"config"},
    "algo": set(),
    "plugins": set(),  # finds reward and environment plug-ins: below both
}
# (importer, imported): an arrow that points the wrong way.
FORBIDDEN = [
    ("algo", "ops"), ("algo", "train"), ("ops", "train"),
    ("rollout", "sync"), ("sync", "control"),
    ("reward", "control"), ("reward", "train"),
    ("plan", "control"),
]
# components that nothing of ours outside them may import (the entry points)
TOP = {"cli"}
# top-level modules, stdlib ones included, that only these components may import
ONLY_IMPORTED_BY = {"argparse": {"cli"}}
# component -> the only third-party top-level modules it may import (stdlib is always allowed)
ONLY_THIRD_PARTY = {"algo": {"torch"}}
# component -> third-party top-level modules that neither it nor anything of ours it reaches may import
NO_THIRD_PARTY = {"reward": {"megatron", "sglang", "sgl_kernel"}}



# ---------------------------------------------------------------------------------------------- graph

def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under `root`."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(source: str, module: str, is_package: bool, filename: str = "<source>") -> set[str]:
    """Every dotted name `source` imports, anywhere in the file (see the module docstring): for
    `from X import a, b` both `X.a` and `X.b` (the caller maps each to the module it names)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, module, is_package)
            if node.module == "__future__":
                continue
            out.update(f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names)
    return out


def _target(name: str, modules: set[str]) -> str | None:
    """The most specific module of ours that `name` names (`pkg.mod.attr` -> `pkg.mod`), or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path, package: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> modules of ours it imports, module -> third-party top-level names it imports, and the
    stdlib ones that ONLY_IMPORTED_BY restricts)."""
    files = package_modules(root, package)
    names = set(files)
    ours: dict[str, set[str]] = {}
    third: dict[str, set[str]] = {}
    for module, path in files.items():
        imported = imports_of(path.read_text(), module, path.name == "__init__.py", str(path))
        ours[module] = set()
        third[module] = set()
        for name in imported:
            top = name.split(".")[0]
            if top == package:
                target = _target(name, names)
                if target is not None and target != module:
                    ours[module].add(target)
            elif top not in sys.stdlib_module_names or top in ONLY_IMPORTED_BY:
                third[module].add(top)
    return ours, third


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def component(module: str, package: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def layer_violations(ours: dict[str, set[str]], third: dict[str, set[str]], package: str,
                     allowed=None, forbidden=None, only_third=None, no_third=None, top=None,
                     only_by=None) -> list[str]:
    """One line per arrow that breaks the stated order (the module docstring)."""
    top = TOP if top is None else top
    only_by = ONLY_IMPORTED_BY if only_by is None else only_by
    allowed = ALLOWED if allowed is None else allowed
    forbidden = FORBIDDEN if forbidden is None else forbidden
    only_third = ONLY_THIRD_PARTY if only_third is None else only_third
    no_third = NO_THIRD_PARTY if no_third is None else no_third
    out: list[str] = []
    for module in sorted(ours):
        src = component(module, package)
        for target in sorted(ours[module]):
            dst = component(target, package)
            if dst == src:
                continue
            if src in allowed and dst not in allowed[src]:
                out.append(f"{module} -> {target}: {src} may import only {sorted(allowed[src]) or 'nothing of ours'}")
            elif (src, dst) in forbidden:
                out.append(f"{module} -> {target}: {src} must not import {dst}")
            elif dst in top:
                out.append(f"{module} -> {target}: nothing of ours outside {dst} imports it")
        for lib in sorted(lib for lib in third[module] if lib in only_by and src not in only_by[lib]):
            out.append(f"{module} -> {lib}: only {sorted(only_by[lib])} may import {lib}")
        if src in only_third:
            for lib in sorted(third[module] - only_third[src]):
                out.append(f"{module} -> {lib}: {src} may import only {sorted(only_third[src])} outside the stdlib")
        if src in no_third:
            for reached in sorted(_reach(ours, module)):
                for lib in sorted(third[reached] & no_third[src]):
                    via = "" if reached == module else f" (through {reached})"
                    out.append(f"{module} -> {lib}{via}: {src} must not load {lib}")
    return out


# ---------------------------------------------------------------------------------------------- tests

def test_no_import_cycles():
    ours, _ = import_graph(ROOT, PACKAGE)
    found = cycles(ours)
    assert not found, "import cycles in megatron_rl/ (break each along its dependencies):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_layer_order():
    ours, third = import_graph(ROOT, PACKAGE)
    problems = layer_violations(ours, third, PACKAGE)
    assert not problems, "arrows against the layer order:\n" + "\n".join(problems)


def test_graph_sees_function_level_and_relative_imports():
    src = ("from . import sibling\nfrom ..up import thing\nimport megatron_rl.a.b\n"
           "def f():\n    from megatron_rl.c import d\n")
    assert imports_of(src, "megatron_rl.pkg.mod", False) == {
        "megatron_rl.pkg.sibling", "megatron_rl.up.thing", "megatron_rl.a.b", "megatron_rl.c.d"}
    assert imports_of("from . import x\n", "megatron_rl.pkg", True) == {"megatron_rl.pkg.x"}


def test_the_real_graph_is_not_empty():
    """Guards the checker itself: a parse that found no arrows would pass everything above."""
    ours, third = import_graph(ROOT, PACKAGE)
    assert "megatron_rl.algo.advantages" in ours
    assert sum(map(len, ours.values())) > 100
    assert "torch" in third["megatron_rl.algo.loss"]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_fails_on_a_synthetic_cycle(tmp_path):
    _write(tmp_path, {
        "fake/__init__.py": "",
        "fake/reward/__init__.py": "",
        "fake/reward/a.py": "from fake.reward.b import g\ndef f():\n    return g()\n",
        "fake/reward/b.py": "def g():\n    from .a import f  # a cycle hidden in a function\n    return f\n",
        "fake/reward/c.py": "from fake.reward import a\n",
    })
    ours, _ = import_graph(tmp_path, "fake")
    assert cycles(ours) == [["fake.reward.a", "fake.reward.b"]]


def test_checker_fails_on_a_synthetic_wrong_way_arrow(tmp_path):
    _write(tmp_path, {
        "fake/__init__.py": "",
        "fake/errors.py": "",
        "fake/config/__init__.py": "from fake.errors import X\n",
        "fake/config/tree.py": "from fake.data.prompts import get_template\n",  # config is not a leaf
        "fake/data/__init__.py": "",
        "fake/data/prompts.py": "from fake.config import X\n",
        "fake/algo/__init__.py": "import numpy\nimport torch\n",
        "fake/algo/loss.py": "from fake.ops import fused\n",
        "fake/ops/__init__.py": "def fused(): pass\n",
        "fake/sync/__init__.py": "",
        "fake/sync/coordinator.py": "from fake.control import mailbox\n",
        "fake/rollout/__init__.py": "from fake.sync import push\n",
        "fake/control/__init__.py": "",
        "fake/train/__init__.py": "import megatron.core\n",
        "fake/reward/__init__.py": "from fake.control import x\n",
        "fake/reward/pool.py": "def f():\n    from fake.train import y\n",
    })
    ours, third = import_graph(tmp_path, "fake")
    assert cycles(ours) == []  # arrows against the order, but no cycle
    problems = layer_violations(ours, third, "fake")
    assert [p.split(":")[0] for p in problems] == [
        "fake.algo -> numpy",
        "fake.algo.loss -> fake.ops",
        "fake.config.tree -> fake.data.prompts",
        "fake.reward -> fake.control",
        "fake.reward.pool -> fake.train",
        "fake.reward.pool -> megatron (through fake.train)",
        "fake.rollout -> fake.sync",
        "fake.sync.coordinator -> fake.control",
    ]
    # the real rules on a clean fake package: nothing to report
    _write(tmp_path, {"fake/config/tree.py": "from fake.errors import X\n", "fake/algo/__init__.py": "import torch\n",
                      "fake/algo/loss.py": "", "fake/rollout/__init__.py": "", "fake/reward/__init__.py": "",
                      "fake/reward/pool.py": "", "fake/sync/coordinator.py": ""})
    ours, third = import_graph(tmp_path, "fake")
    assert layer_violations(ours, third, "fake") == []


def test_checker_fails_on_synthetic_cli_and_plan_violations(tmp_path):
    """Only cli parses arguments, nothing imports cli, and the offline planner does not import the runtime."""
    _write(tmp_path, {
        "fake/__init__.py": "",
        "fake/cli/__init__.py": "import argparse\nfrom fake.cli import common\nfrom fake.plan import place\n",
        "fake/cli/common.py": "import argparse\n",
        "fake/control/__init__.py": "import argparse\n",
        "fake/control/main.py": "def f():\n    from fake.cli.common import x\n",
        "fake/plan/__init__.py": "from fake.control import layout\n",
        "fake/data/__init__.py": "from argparse import Namespace\n",
    })
    assert "argparse" in import_graph(tmp_path, "fake")[1]["fake.cli"]  # stdlib, but tracked: a rule restricts it
    assert _arrows_against_the_order(tmp_path) == [
        "fake.control -> argparse",
        "fake.control.main -> fake.cli.common",
        "fake.data -> argparse",
        "fake.plan -> fake.control",
    ]
    _write(tmp_path, {"fake/control/__init__.py": "", "fake/control/main.py": "", "fake/plan/__init__.py": "",
                      "fake/data/__init__.py": ""})
    assert _arrows_against_the_order(tmp_path) == []


def _arrows_against_the_order(root: Path) -> list[str]:
    """The `importer -> imported` part of each line layer_violations reports for the package `fake`."""
    ours, third = import_graph(root, "fake")
    return [line.split(":")[0] for line in layer_violations(ours, third, "fake")]
