"""Every config key is read by the code of the run, so a knob never does nothing.

The keys come from the config tree (`dataclasses.fields` of each section of `megatron_rl.config.Config`),
so adding a key that nothing reads fails here. The reads are found in the AST of every .py file under
megatron_rl/ except the config/ package (which declares, validates and documents keys; its length-stage
resolution counts as declaring the keys it reads). A key `section.name` counts as read where
- an attribute `<expr>.name` is loaded, unless it is a method call (`x.name(...)`) or its base is the
  argparse namespace `args`; or
- `getattr(<expr>, "name")` appears; or
- a string subscript `<cfg>["name"]` appears on a config object (a base whose name holds cfg/config).
The match is by name, not by section: it catches a dead key, not a key read from the wrong section.
"""
from __future__ import annotations

import ast
import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config import Config

ROOT = Path(__file__).resolve().parents[2]
NOT_READERS = "megatron_rl/config/"

# Keys known to be unread while their owners wire them up (issue 13). Each entry must still be a key
# that nothing reads (test_pending_allowlist_names_only_unread_keys fails otherwise): remove it in the
# commit that makes the run read (or deletes) its key, and keep this set empty.
PENDING: set[str] = set()


def config_keys(root: type) -> list[str]:
    """`section.name` for every field of every section dataclass of `root`; a block nested in a section
    (trainer.lora) gives its own keys (`trainer.lora.rank`), the block name itself being read with them."""
    def keys(cls: type, prefix: str) -> list[str]:
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            nested = dataclasses.is_dataclass(hints[f.name])
            out += keys(hints[f.name], f"{prefix}.{f.name}") if nested else [f"{prefix}.{f.name}"]
        return out

    hints = typing.get_type_hints(root)
    return [k for section in dataclasses.fields(root) for k in keys(hints[section.name], section.name)]


def _base_name(node: ast.AST) -> str:
    """The name at the root of an attribute/subscript/call chain (`self.cfg.run` -> `cfg`, its last part)."""
    while True:
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return node.attr
            node = node.value
        elif isinstance(node, (ast.Subscript, ast.Call)):
            node = node.value if isinstance(node, ast.Subscript) else node.func
        else:
            return node.id if isinstance(node, ast.Name) else ""


def names_read(source: str, filename: str = "<source>") -> set[str]:
    """Names that `source` reads as config keys under the rules of this module's docstring."""
    tree = ast.parse(source, filename)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and id(n) not in called:
            if not (isinstance(n.value, ast.Name) and n.value.id == "args"):
                out.add(n.attr)
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr"
              and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)):
            out.add(n.args[1].value)
        elif (isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)
              and any(w in _base_name(n.value).lower() for w in ("cfg", "config"))):
            out.add(n.slice.value)
    return out


def unread_keys(root: type, sources: dict[str, str]) -> list[str]:
    """Keys of the config tree `root` that no source (filename -> text) reads."""
    read: set[str] = set()
    for filename, text in sources.items():
        read |= names_read(text, filename)
    return [key for key in config_keys(root) if key.rsplit(".", 1)[1] not in read]


def run_sources() -> dict[str, str]:
    files = sorted((ROOT / "megatron_rl").rglob("*.py"))
    return {str(p.relative_to(ROOT)): p.read_text() for p in files
            if not str(p.relative_to(ROOT)).startswith(NOT_READERS)}


def test_every_config_key_is_read_by_the_run():
    unread = [k for k in unread_keys(Config, run_sources()) if k not in PENDING]
    assert not unread, (f"config keys that no code outside megatron_rl/config/ reads: {', '.join(unread)} -- "
                        f"make the run honour each one, or delete it from its section in megatron_rl/config/ (then run "
                        f"tools/gen_config_docs.py)")


def test_pending_allowlist_names_only_unread_keys():
    keys, unread = set(config_keys(Config)), set(unread_keys(Config, run_sources()))
    stale = sorted(k for k in PENDING if k not in keys or k not in unread)
    assert not stale, f"remove from PENDING in {Path(__file__).name} (no longer a key, or now read): {stale}"


# ------------------------------------------------------------------ the checker on a made-up tree

@dataclass
class _Section:
    used: int = 0
    unused: int = 0
    only_called: int = 0
    only_args: int = 0
    only_stored: int = 0
    by_getattr: int = 0
    by_subscript: int = 0
    dict_key: int = 0


@dataclass
class _Root:
    sec: _Section = dataclasses.field(default_factory=_Section)


SNIPPET = '''
def f(cfg, args, row):
    x = cfg.sec.used
    cfg.sec.only_called()
    y = args.only_args
    cfg.sec.only_stored = 3
    z = getattr(cfg.sec, "by_getattr")
    w = self.cfg_dict["sec"]["by_subscript"]
    return row["dict_key"]
'''


def test_checker_flags_a_key_nothing_reads():
    assert config_keys(_Root)[0] == "sec.used"
    assert unread_keys(_Root, {"snippet.py": SNIPPET}) == [
        "sec.unused", "sec.only_called", "sec.only_args", "sec.only_stored", "sec.dict_key"]
    assert unread_keys(_Root, {"snippet.py": SNIPPET, "other.py": "v = c.unused"}) == [
        "sec.only_called", "sec.only_args", "sec.only_stored", "sec.dict_key"]


def test_a_dead_key_added_to_the_real_tree_is_flagged():
    from megatron_rl.config import RunConfig

    run_with_typo = dataclasses.make_dataclass("RunWithTypo", [("log_evry", int, 1)], bases=(RunConfig,))
    root = dataclasses.make_dataclass("Root", [("run", run_with_typo)])
    assert unread_keys(root, run_sources()) == ["run.log_evry"]
