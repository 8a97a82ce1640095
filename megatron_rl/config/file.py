"""Reading a YAML config file into a plain tree, with one-line errors that name the file, line and key.

Beyond `yaml.safe_load`: the text must be UTF-8, a key given twice in one mapping is an error at any
depth (YAML would keep the last one silently), an empty file is an error (leave the file out to get
the defaults), and the line of every dotted key is kept so that a later error about a value
(`locate_error`) can point at the line that set it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.tree import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"


def yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML error: its problem and where (PyYAML's own text spans several lines)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def _key_lines(node: yaml.Node, path: Path, prefix: str, lines: dict[str, int], seen: set[int]) -> None:
    """Record the line of each dotted key under `node`; a key twice in one mapping is a ConfigError."""
    if id(node) in seen:  # an alias of a node already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *anchor` merges defaults that the mapping may override
                continue
            name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            key = f"{prefix}.{name}" if prefix else name
            line = key_node.start_mark.line + 1
            if name in first:
                raise ConfigError(f"{path}:{line}: {key}: duplicate key (first set at line {first[name]}); "
                                  "keep one")
            first[name] = line
            lines.setdefault(key, line)
            _key_lines(value_node, path, key, lines, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.setdefault(f"{prefix}[{i}]", item.start_mark.line + 1)
            _key_lines(item, path, f"{prefix}[{i}]", lines, seen)


def _parse(text: str, path: Path) -> tuple[Any, dict[str, int]]:
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as e:  # a control character, found before any parsing
        line = text[:e.position].count("\n") + 1
        raise ConfigError(f"{path}:{line}: invalid YAML: {str(e).splitlines()[0]}") from None
    try:
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        if node is not None:
            _key_lines(node, path, "", lines, set())
        return (loader.construct_document(node) if node is not None else None), lines
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {yaml_problem(e)}") from None
    except ConfigError:
        raise
    except ValueError as e:  # an integer of more digits than int() takes
        raise ConfigError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
    finally:
        loader.dispose()


def _not_utf8(raw: bytes, err: UnicodeDecodeError, path: Path) -> ConfigError:
    """The error for a file that is not UTF-8: its line, and the key set on or above that line."""
    line = raw[:err.start].count(b"\n") + 1
    key = ""
    try:
        _, lines = _parse(raw.decode("utf-8", errors="replace"), path)
        above = [k for k, n in lines.items() if n <= line]
        key = f" {max(above, key=lambda k: lines[k])}:" if above else ""
    except ConfigError:
        pass
    return ConfigError(f"{path}:{line}:{key} not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); "
                       "save the file as UTF-8")


def read_yaml(path: Path, what: str = "config file") -> tuple[Any, dict[str, int]]:
    """(plain data or None when empty, line of each dotted key) of a UTF-8 YAML file without duplicate
    keys; ConfigError naming the file (`what` names its kind when it is missing)."""
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(raw, e, path) from None
    return _parse(text, path)


def read_config_file(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """(plain tree, line of each dotted key) of a YAML config file; ConfigError naming the file if unusable."""
    data, lines = read_yaml(path)
    if data is None:
        raise ConfigError(f"{path}: empty config file (no sections); give at least one section such as "
                          "`run:`, or leave the file out to use the defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections (algo:, rollout:, ...), "
                          f"got {type(data).__name__}")
    return data, lines


_KEY = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def locate_error(err: ConfigError, path: Path, lines: dict[str, int], overrides: list[str]) -> ConfigError:
    """`err` (which starts with the dotted key) prefixed with `path:line` where the file set that key;
    unchanged when a command-line override set it, or names a section on an override's path (a typo in
    `traner.lr=...`): the message names the key the user typed."""
    msg = str(err)
    match = _KEY.match(msg)
    if match is None:
        return err
    key = match.group(1)
    overridden = {ov.split("=", 1)[0].strip() for ov in overrides}
    if any(key == o or key.startswith((o + ".", o + "[")) or o.startswith(key + ".") for o in overridden):
        return err
    probe = key
    while probe and probe not in lines:  # the nearest enclosing key the file sets
        probe = re.sub(r"(\.[^.\[\]]*|\[\d+\])$", "", probe) if re.search(r"[.\[]", probe) else ""
    return ConfigError(f"{path}:{lines[probe]}: {msg}" if probe else f"{path}: {msg}")
