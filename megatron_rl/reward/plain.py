"""Plain data across the sandbox boundary: a type-tagged JSON encoding of None, bool, int, float, str,
bytes, list, tuple, set, frozenset and dict -- nothing else.

The function-call harness uses it both ways: the verifier encodes the arguments of each call, the
program inside the sandbox (call_runner) encodes each result, and the verifier decodes it. Decoding
builds fresh objects of exactly these built-in types from JSON text, so what reaches the comparison
carries no code of the candidate's (no ``__eq__``, no ``__del__``, no subclass): a frame can only say
*which* plain value was returned. Anything else is a ``PlainError``.

JSON gives null, booleans, numbers, strings and arrays (= list) directly; every other type is a
one-key object: ``{"tuple": [...]}``, ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"dict":
[[key, value], ...]}`` (keys of any hashable plain type), ``{"bytes": "<base64>"}`` and ``{"int":
"<hex>"}`` for integers past 64 bits (hex has no digit limit, decimal conversion of a huge int does).
Floats keep their type (``1.0`` stays a float) and NaN / Infinity are allowed.

Subclasses of the plain types (a namedtuple, an IntEnum, OrderedDict, Counter, a str subclass with its
own ``__eq__``) are encoded as their base type's value: the override never leaves the process.

Only the standard library is imported: this file is copied into the sandbox next to the runner.
"""
from __future__ import annotations

import base64
import json
from typing import Any

MAX_DEPTH = 100  # containers nested deeper are refused on both sides (no RecursionError in the verifier)
MAX_SHARED_HASHES = 64  # elements of one set (keys of one dict) that may repeat another's hash value
TAGS = ("tuple", "set", "frozenset", "dict", "bytes", "int")
_SMALL_INT = 1 << 63


class PlainError(ValueError):
    """A value is not plain data (encoding) or a text is not a valid encoding (decoding)."""


def encode(value: Any) -> Any:
    """The JSON-able form of a plain value; PlainError for anything else (a cycle, depth > MAX_DEPTH)."""
    return _encode(value, 0, set())


def _encode(v: Any, depth: int, path: set[int]) -> Any:
    if v is None or v is True or v is False:
        return v
    if isinstance(v, int):  # bool is handled above
        n = int.__int__(v)
        return n if -_SMALL_INT < n < _SMALL_INT else {"int": hex(n)}
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(v)).decode("ascii")}
    if depth >= MAX_DEPTH:
        raise PlainError(f"nested deeper than {MAX_DEPTH}")
    if id(v) in path:
        raise PlainError("a container that contains itself")
    path.add(id(v))
    try:
        if isinstance(v, list):
            return [_encode(x, depth + 1, path) for x in list.__iter__(v)]
        if isinstance(v, tuple):
            return {"tuple": [_encode(x, depth + 1, path) for x in tuple.__iter__(v)]}
        if isinstance(v, (set, frozenset)):
            tag = "set" if isinstance(v, set) else "frozenset"
            return {tag: [_encode(x, depth + 1, path) for x in list(v)]}
        if isinstance(v, dict):
            return {"dict": [[_encode(k, depth + 1, path), _encode(x, depth + 1, path)]
                             for k, x in list(dict.items(v))]}
    finally:
        path.discard(id(v))
    raise PlainError(f"a {type(v).__name__} is not plain data")


def dumps(value: Any) -> str:
    """One line of JSON for a plain value."""
    return json.dumps(encode(value), separators=(",", ":"))


def decode(obj: Any) -> Any:
    """The plain value of a decoded JSON document; PlainError when it is no valid encoding."""
    return _decode(obj, 0)


def _decode(o: Any, depth: int) -> Any:
    if o is None or isinstance(o, (bool, int, float, str)):
        return o
    if depth >= MAX_DEPTH:
        raise PlainError(f"nested deeper than {MAX_DEPTH}")
    if isinstance(o, list):
        return [_decode(x, depth + 1) for x in o]
    if not isinstance(o, dict) or len(o) != 1 or next(iter(o)) not in TAGS:
        raise PlainError(f"not a plain-data encoding: {str(o)[:80]}")
    tag, body = next(iter(o.items()))
    if tag == "int" or tag == "bytes":
        return _scalar(tag, body)
    if not isinstance(body, list):
        raise PlainError(f"{tag}: a list is needed")
    items = [_decode(x, depth + 1) for x in body]
    if tag == "tuple":
        return tuple(items)
    if tag == "dict":
        if not all(isinstance(p, list) and len(p) == 2 for p in items):
            raise PlainError("dict: a list of [key, value] pairs is needed")
        check_hashes([k for k, _ in items], tag)
        return {k: v for k, v in items}
    check_hashes(items, tag)
    return set(items) if tag == "set" else frozenset(items)


def check_hashes(items: list, what: str) -> None:
    """PlainError when ``items`` cannot all be hashed, or more than MAX_SHARED_HASHES repeat a hash value:
    ints hash modulo 2**61 - 1, so a program can make thousands collide, and Python builds a set of n
    colliding elements in O(n^2) -- seconds to minutes of the verifier's time for one result."""
    try:
        shared = len(items) - len({hash(x) for x in items})
    except TypeError as e:  # an unhashable key or set element
        raise PlainError(f"{what}: {e}") from None
    if shared > MAX_SHARED_HASHES:
        raise PlainError(f"{what}: {shared} elements repeat the hash value of another")


def _scalar(tag: str, body: Any) -> int | bytes:
    if not isinstance(body, str):
        raise PlainError(f"{tag}: a string is needed")
    try:
        return int(body, 16) if tag == "int" else base64.b64decode(body, validate=True)
    except ValueError as e:
        raise PlainError(f"{tag}: {e}") from None


def loads(text: str | bytes) -> Any:
    """The plain value of one JSON document; PlainError for invalid JSON, nesting too deep for the
    parser, or no valid encoding."""
    try:
        return decode(json.loads(text))
    except (ValueError, RecursionError) as e:
        raise PlainError(f"{type(e).__name__}: {str(e)[:120]}") from None
