"""Assert code -> function-call tests, read with `ast` in the verifier: the test code is parsed here,
never run here (docs/reward.md "Function-call tests" lists the accepted forms).

Test code is MBPP-style top-level asserts (``assert f(1) == 2``), HumanEval's ``def check(candidate)``
(``candidate`` stands for the task's entry point), or pytest-style ``def test_*():`` functions (with
``from solution import f``). The function under test is the entry point, ``candidate``, a name
imported from ``solution``, or (with no entry point) a name the code calls without defining it;
``Solution().method(...)`` is LeetCode's class form. Each assert that calls it must take one of these forms, where R is the call,
optionally passed through built-ins of reward.compare.WRAPS (``sorted(f(x))``, ``round(f(x), 2)``):
``R == E`` / ``E == R`` / ``R != E`` / ``R is True|False|None`` / ``R in E`` / ``R`` / ``not R`` /
``abs(R - E) < T`` (or ``<=``, ``math.fabs``, ``E - R``) / ``math.isclose(R, E, rel_tol=, abs_tol=)``,
and ``R == R'`` with the same call on both sides (HumanEval/33 compares the function with itself: only
"returns plain data" is checked). Any other use of the function -- its result stored in a variable, passed
to other code, a call nested in its arguments -- is refused with the line, and so is an assert that
always fails. Asserts without the function are the test code's own business.

When every value (arguments, expected value, tolerances) is a constant (`const`: literals, arithmetic
on small numbers, set/tuple/float(...) of those) and nothing else in the code runs, the tests are built here
(`convert` returns CallTests). Otherwise -- loops, variables, helper functions, random inputs -- the
code must run to give its values: `convert` returns an Expansion, the code with each accepted assert
replaced by a recording call, which reward.expand runs in the sandbox without the candidate.
"""
from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field

from megatron_rl.reward import plain
from megatron_rl.reward.call_types import CallTest, Expansion, Form, TestFormError
from megatron_rl.reward.compare import FLOAT_ABS_TOL, FLOAT_REL_TOL, WRAPS

RECORDER = "__mrl__"  # the name the expansion program records through (reward.call_runner binds it)
_CONST_CALLS = {f.__name__: f for f in (set, frozenset, tuple, list, dict, float, int, str, bool, sorted)}
_BUILTINS = set(dir(builtins))
_INERT = (ast.Import, ast.ImportFrom, ast.Pass, ast.FunctionDef, ast.AsyncFunctionDef)
_NOT_CONST = object()  # const(): not a constant expression


@dataclass
class _Match:
    """An accepted assert: the call of the function under test and the expression nodes of its values."""

    op: str
    call: ast.Call
    target: str
    wraps: list[tuple[str, list[ast.expr]]]  # innermost first
    expected: ast.expr | None = None
    tolerance: str = "default"  # default | abs | isclose
    rel_tol: ast.expr | None = None
    abs_tol: ast.expr | None = None
    consumed: list[ast.AST] = field(default_factory=list)  # nodes naming the function, used by this assert


def tolerances(kind: str, rel: float | None, abs_: float | None) -> tuple[float, float]:
    """(rel_tol, abs_tol) of an assert form: the module defaults, ``abs(R - E) < T`` (absolute only), or
    math.isclose's own defaults (rel 1e-9, abs 0) where its keywords are absent."""
    if kind == "abs":
        return 0.0, abs_
    if kind == "isclose":
        return (1e-9 if rel is None else rel), (0.0 if abs_ is None else abs_)
    return FLOAT_REL_TOL, FLOAT_ABS_TOL


class _Code:
    """Names of one piece of test code: what it binds, and which names are the function under test."""

    def __init__(self, tree: ast.Module, entry_point: str | None):
        self.tree = tree
        self.bound = _bound_names(tree)
        self.from_solution = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                              and n.module == "solution" for a in n.names}
        self.check = _check_function(tree)
        self.tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
        self.targets: dict[str, str] = {}  # name in the code -> target of the call
        if entry_point is None:  # MBPP style: the functions the code calls without defining them
            free = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            self.targets = {name: name for name in free - self.bound - _BUILTINS}
        for name in self.from_solution:
            self.targets[name] = name
        if entry_point is not None:  # "Class.method": the class name, for Class().method(...)
            self.targets[entry_point.split(".")[0]] = entry_point.split(".")[0]
        if self.check is not None:
            if entry_point is None:
                raise TestFormError("`def check(candidate)` needs the entry point: the function `candidate` "
                                    "stands for (task key entry_point)")
            self.targets[self.check.args.args[0].arg] = entry_point

    def target_of(self, node: ast.AST) -> tuple[str, list[ast.AST]] | None:
        """(target, nodes naming it) when ``node`` is a call of the function under test."""
        if not isinstance(node, ast.Call):
            return None
        f = node.func
        if isinstance(f, ast.Name) and f.id in self.targets:
            return self.targets[f.id], [f]
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name)
                and f.value.func.id in self.targets and "." not in self.targets[f.value.func.id]
                and not f.value.args and not f.value.keywords):
            return f"{f.value.func.id}.{f.attr}", [f.value.func]
        return None

    def mentions_target(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in self.targets for n in ast.walk(node))


def _bound_names(tree: ast.Module) -> set[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names if not
                      (isinstance(n, ast.ImportFrom) and n.module == "solution")}
    return names


def _check_function(tree: ast.Module) -> ast.FunctionDef | None:
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name == "check":
            if len(n.args.args) != 1 or n.args.vararg or n.args.kwarg or n.args.kwonlyargs:
                raise TestFormError(f"line {n.lineno}: `def check` must take one argument (the function under test)")
            return n
    return None


def _unwrap(code: _Code, node: ast.expr) -> tuple[ast.Call, str, list, list[ast.AST]] | None:
    """(call, target, wraps, nodes naming the function) when ``node`` is R: a call of the function under
    test, possibly inside built-ins of WRAPS given as first argument (``round(f(x), 2)``)."""
    wraps: list[tuple[str, list[ast.expr]]] = []
    while True:
        found = code.target_of(node)
        if found is not None:
            return node, found[0], wraps[::-1], found[1]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in WRAPS
                and node.func.id not in code.bound and node.args and not node.keywords
                and not any(isinstance(a, ast.Starred) for a in node.args)):
            return None
        wraps.append((node.func.id, node.args[1:]))
        node = node.args[0]


def _match(code: _Code, test: ast.expr) -> _Match | None:
    """The accepted form of an assert's test, or None."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        r = _unwrap(code, test.operand)
        return _Match("falsy", r[0], r[1], r[2], consumed=r[3]) if r else None
    if isinstance(test, ast.Call):
        r = _unwrap(code, test)
        if r:
            return _Match("truthy", r[0], r[1], r[2], consumed=r[3])
        return _match_isclose(code, test)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if isinstance(op, (ast.Lt, ast.LtE)):
        return _match_abs(code, left, right)
    lr, rr = _unwrap(code, left), _unwrap(code, right)
    if isinstance(op, ast.Eq) and lr and rr:
        same = lr[1] == rr[1] and _dump(lr[0], lr[2]) == _dump(rr[0], rr[2])
        return _Match("returns", lr[0], lr[1], lr[2], consumed=lr[3] + rr[3]) if same else None
    if lr and isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.In)):
        name = {ast.Eq: "eq", ast.NotEq: "ne", ast.Is: "is", ast.In: "in"}[type(op)]
        if name == "is" and not _is_singleton(right):
            return None
        return _Match(name, lr[0], lr[1], lr[2], right, consumed=lr[3])
    if rr and isinstance(op, (ast.Eq, ast.NotEq)):
        return _Match("eq" if isinstance(op, ast.Eq) else "ne", rr[0], rr[1], rr[2], left, consumed=rr[3])
    return None


def _dump(call: ast.Call, wraps: list) -> str:
    """The arguments and wraps of a call, without the name it was called by (candidate vs entry point)."""
    return ast.dump(ast.Tuple([*call.args, *(k.value for k in call.keywords)], ast.Load())) + repr(
        [(n, [ast.dump(a) for a in xs]) for n, xs in wraps]) + repr([k.arg for k in call.keywords])


def _is_singleton(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and any(node.value is v for v in (True, False, None))


def _match_abs(code: _Code, left: ast.expr, tol: ast.expr) -> _Match | None:
    """``abs(R - E) < T`` / ``math.fabs(E - R) <= T``."""
    if not (isinstance(left, ast.Call) and len(left.args) == 1 and not left.keywords
            and (_is_name(left.func, "abs", code) or _is_math(left.func, "fabs"))):
        return None
    diff = left.args[0]
    if not (isinstance(diff, ast.BinOp) and isinstance(diff.op, ast.Sub)):
        return None
    for r_node, e_node in ((diff.left, diff.right), (diff.right, diff.left)):
        r = _unwrap(code, r_node)
        if r and not code.mentions_target(e_node):
            return _Match("eq", r[0], r[1], r[2], e_node, "abs", None, tol, consumed=r[3])
    return None


def _match_isclose(code: _Code, test: ast.Call) -> _Match | None:
    """``math.isclose(R, E, rel_tol=..., abs_tol=...)`` (either argument order)."""
    if not (_is_name(test.func, "isclose", code, builtin=False) or _is_math(test.func, "isclose")):
        return None
    kw = {k.arg: k.value for k in test.keywords}
    if len(test.args) != 2 or set(kw) - {"rel_tol", "abs_tol"}:
        return None
    for r_node, e_node in ((test.args[0], test.args[1]), (test.args[1], test.args[0])):
        r = _unwrap(code, r_node)
        if r and not code.mentions_target(e_node):
            return _Match("eq", r[0], r[1], r[2], e_node, "isclose", kw.get("rel_tol"), kw.get("abs_tol"), r[3])
    return None


def _is_name(node: ast.expr, name: str, code: _Code, builtin: bool = True) -> bool:
    """``name`` itself: the built-in (not rebound by the code) or, for builtin=False, an imported one."""
    return isinstance(node, ast.Name) and node.id == name and ((name not in code.bound) == builtin)


def _is_math(node: ast.expr, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "math")


def const(node: ast.expr | None):
    """The value of a constant expression: literals, containers of them, arithmetic on small numbers,
    and set/tuple/float(...) of those (``set((4, 5))``, ``float('inf')``, ``2.0 / 3.0``); _NOT_CONST
    for anything else. Nothing of the code is run: only these are computed, with operands bounded."""
    if node is None:
        return None
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [const(e) for e in node.elts]
        if _NOT_CONST in items or any(isinstance(e, ast.Starred) for e in node.elts):
            return _NOT_CONST
        return _container(type(node), items)
    if isinstance(node, ast.Dict):
        keys, values = [const(k) for k in node.keys], [const(v) for v in node.values]
        return _NOT_CONST if _NOT_CONST in keys + values else _container(ast.Dict, list(zip(keys, values)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = const(node.operand)
        return _arith(node.op, 0, value) if _small_number(value) else _NOT_CONST
    if isinstance(node, ast.BinOp):
        left, right = const(node.left), const(node.right)
        if isinstance(left, str) and (isinstance(node.op, ast.Add) and isinstance(right, str) or isinstance(
                node.op, ast.Mult) and _small_number(right) and isinstance(right, int) and right <= 1 << 16):
            return _arith(node.op, left, right)  # 'ab' + 'cd', 'ab' * 3
        return _arith(node.op, left, right) if _small_number(left) and _small_number(right) else _NOT_CONST
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CONST_CALLS
            and not node.keywords and len(node.args) <= 1):
        args = [const(a) for a in node.args]
        if _NOT_CONST not in args:
            return _safely(lambda: _CONST_CALLS[node.func.id](*args))
    return _NOT_CONST


def _container(kind: type, items: list):
    if kind is ast.Dict:
        return _safely(lambda: dict(items))
    return {ast.Tuple: tuple, ast.List: list, ast.Set: lambda xs: _safely(lambda: set(xs))}[kind](items)


def _small_number(v) -> bool:
    """Operands of constant arithmetic: numbers, ints under 256 bits (so no expression can blow up)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (isinstance(v, float) or v.bit_length() <= 256)


_ARITH = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
          ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
          ast.USub: lambda _, b: -b, ast.UAdd: lambda _, b: +b,
          ast.Pow: lambda a, b: a ** b if isinstance(b, float) or 0 <= b <= 256 else _NOT_CONST}


def _arith(op: ast.AST, a, b):
    fn = _ARITH.get(type(op))
    return _NOT_CONST if fn is None else _safely(lambda: fn(a, b))


def _safely(fn):
    try:
        return fn()
    except (ArithmeticError, ValueError, TypeError):
        return _NOT_CONST


def _source(node: ast.AST) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= 160 else text[:160] + "..."


class _Asserts(ast.NodeVisitor):
    """Every assert of the code in source order, matched, with whether it runs where the literal path can
    see it (directly in the module, in check or in a test function) and whether all else is inert."""

    def __init__(self, code: _Code):
        self.code = code
        bodies = [code.tree.body] + [f.body for f in [code.check, *code.tests] if f is not None]
        self.direct = {id(s): group for group, body in enumerate(bodies) for s in body}
        self.found: list[tuple[int, ast.Assert, _Match]] = []  # (group, assert, match); group -1: not direct
        self.inert = all(_inert(s, code) for body in bodies for s in body)

    def visit_Assert(self, node: ast.Assert) -> None:
        code = self.code
        where = f"line {node.lineno}: `{_source(node)}`"
        if not code.mentions_target(node.test):
            value = const(node.test)
            if value is _NOT_CONST:
                self.inert = False  # the code's own check: it must run
            elif not value:
                raise TestFormError(f"{where}: this assert always fails")
            return
        m = _match(code, node.test)
        if m is None:
            raise TestFormError(f"{where}: not an accepted form of assert on the function under test "
                                "(R == E, R != E, R is True/False/None, R in E, R, not R, abs(R - E) < T, "
                                "math.isclose(R, E); R = the call, optionally inside set/sorted/round/...)")
        values = [*m.call.args, *(k.value for k in m.call.keywords), *(a for _, xs in m.wraps for a in xs)]
        if m.op != "returns" and m.expected is not None:
            values.append(m.expected)
        if any(code.mentions_target(v) for v in values):
            raise TestFormError(f"{where}: the function under test appears in its own arguments or expected value")
        self.found.append((self.direct.get(id(node), -1), node, m))


def _inert(stmt: ast.stmt, code: _Code) -> bool:
    """True when running ``stmt`` cannot change what the asserts check: imports, definitions (a check or
    test function's body is examined itself), literal assignments, docstrings, a bare name."""
    if isinstance(stmt, (ast.Assert, *_INERT)):
        return True
    if isinstance(stmt, ast.Expr):
        return isinstance(stmt.value, (ast.Constant, ast.Name)) or _is_check_call(stmt, code)
    if isinstance(stmt, ast.Assign):
        return const(stmt.value) is not _NOT_CONST and all(isinstance(t, ast.Name) for t in stmt.targets)
    return False


def _is_check_call(stmt: ast.stmt, code: _Code) -> bool:
    """``check(f)`` at the top of the code: the verifier calls check itself."""
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and code.check is not None
            and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "check")


def _refuse_other_uses(code: _Code, found: list[tuple[int, ast.Assert, _Match]]) -> None:
    """A TestFormError naming the line of any use of the function outside an accepted assert (its result
    stored, passed on, the function handed to other code): only asserts say what is checked."""
    consumed = {id(n) for _, _, m in found for n in m.consumed}
    skipped = {id(n) for s in code.tree.body if _is_check_call(s, code) for n in ast.walk(s)}
    skipped |= {id(n) for a in ast.walk(code.tree) if isinstance(a, ast.Assert) and a.msg for n in ast.walk(a.msg)}
    for n in ast.walk(code.tree):
        if (isinstance(n, ast.Name) and n.id in code.targets and isinstance(n.ctx, ast.Load)
                and id(n) not in consumed and id(n) not in skipped):
            raise TestFormError(f"line {n.lineno}: `{n.id}` (the function under test) is used outside an "
                                "accepted assert: its results can only be checked by asserts")


def _literal_test(m: _Match, where: str) -> CallTest | None:
    """The CallTest of a match whose values are all literals; None when one is not."""
    if any(isinstance(a, ast.Starred) for a in m.call.args) or any(k.arg is None for k in m.call.keywords):
        return None
    args = [const(a) for a in m.call.args]
    kwargs = {k.arg: const(k.value) for k in m.call.keywords}
    wraps = [(name, [const(a) for a in extra]) for name, extra in m.wraps]
    expected = None if m.op == "returns" else const(m.expected)
    rel, abs_ = const(m.rel_tol), const(m.abs_tol)
    values = [*args, *kwargs.values(), *(a for _, xs in wraps for a in xs), expected, rel, abs_]
    if any(v is _NOT_CONST for v in values):
        return None
    return build_test(m.target, m.op, args, kwargs, expected, tolerances(m.tolerance, rel, abs_),
                      [(n, xs) for n, xs in wraps], where)


def build_test(target: str, op: str, args: list, kwargs: dict, expected, tols: tuple[float, float],
               wraps: list, source: str) -> CallTest:
    """A CallTest from values (literal here, or recorded by the expansion), checked to be plain data."""
    try:
        for v in (args, kwargs, expected, [xs for _, xs in wraps]):
            plain.encode(v)
        return CallTest(target, tuple(args), dict(kwargs), op, expected, tols[0], tols[1],
                        tuple((n, tuple(xs)) for n, xs in wraps), source)
    except (plain.PlainError, TestFormError) as e:
        raise TestFormError(f"{source}: {e}") from None


def convert(text: str, entry_point: str | None = None) -> tuple[CallTest, ...] | Expansion:
    """The function-call tests of assert code (CallTests when all is literal, else an Expansion);
    TestFormError (one line, with the line of the code) for code that cannot be graded safely."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise TestFormError(f"test code is not valid Python: {e.msg} (line {e.lineno})") from None
    code = _Code(tree, entry_point)
    for f in code.tests:
        if f.args.args or f.args.vararg or f.args.kwarg:
            raise TestFormError(f"line {f.lineno}: `def {f.name}` takes arguments (pytest fixtures are not supported)")
    visitor = _Asserts(code)
    visitor.visit(tree)
    _refuse_other_uses(code, visitor.found)
    if not visitor.found:
        raise TestFormError("test code has no assert on the function under test")
    if visitor.inert:
        direct = sorted((g, i) for i, (g, _, _) in enumerate(visitor.found) if g >= 0)
        tests = [_literal_test(visitor.found[i][2], f"line {visitor.found[i][1].lineno}: "
                               f"`{_source(visitor.found[i][1])}`") for _, i in direct]
        if tests and None not in tests:
            return tuple(tests)
    return _expansion(code, visitor.found)


class _Rewrite(ast.NodeTransformer):
    """The expansion program: accepted asserts become recording calls; the function's definitions and
    imports from `solution` go (its name is bound to a refusing stub); a top-level check(f) goes."""

    def __init__(self, code: _Code, found: list[tuple[int, ast.Assert, _Match]]):
        self.code = code
        self.index = {id(a): (k, m) for k, (_, a, m) in enumerate(found)}

    def visit_Assert(self, node: ast.Assert):
        if id(node) not in self.index:
            return node
        k, m = self.index[id(node)]
        rec = ast.Call(ast.Attribute(ast.Name(RECORDER, ast.Load()), "call", ast.Load()),
                       [ast.Constant(k), *m.call.args], m.call.keywords)
        extras = ast.Tuple([ast.Tuple(list(xs), ast.Load()) for _, xs in m.wraps], ast.Load())
        values = [m.expected if m.op != "returns" and m.expected is not None else ast.Constant(None),
                  m.rel_tol or ast.Constant(None), m.abs_tol or ast.Constant(None), extras]
        return ast.copy_location(ast.Expr(ast.Call(ast.Attribute(rec, "expect", ast.Load()), values, [])), node)

    def visit_Module(self, node: ast.Module):
        node.body = [s for s in node.body if not self._dropped(s)]
        return self.generic_visit(node)

    def _dropped(self, s: ast.stmt) -> bool:
        return ((isinstance(s, ast.ImportFrom) and s.module == "solution") or _is_check_call(s, self.code)
                or (isinstance(s, (ast.FunctionDef, ast.ClassDef)) and s.name in self.code.targets))


def _expansion(code: _Code, found: list[tuple[int, ast.Assert, _Match]]) -> Expansion:
    forms = tuple(Form(m.target, m.op, tuple(n for n, _ in m.wraps), m.tolerance,
                       f"line {a.lineno}: `{_source(a)}`") for _, a, m in found)
    tree = ast.fix_missing_locations(_Rewrite(code, found).visit(code.tree))
    return Expansion(ast.unparse(tree), forms, tuple(sorted(code.targets)),
                     code.check.name if code.check is not None else None, tuple(f.name for f in code.tests))


def parse_call(text: str) -> tuple[str, list, dict]:
    """``f(1, [2])`` or ``Solution().twoSum([2, 7], 9)`` -> (target, args, kwargs), literal arguments
    only (as `const` reads them); TestFormError otherwise."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise TestFormError(f"call {text[:80]!r} is not valid Python: {e.msg}") from None
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    code = _Code(ast.Module([], []), None)
    code.targets = {name: name for name in names}
    found = code.target_of(node)
    if found is None:
        raise TestFormError(f"call {text[:80]!r} must be f(...) or Class().method(...)")
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        raise TestFormError(f"call {text[:80]!r}: write the arguments out (no * or **)")
    args, kwargs = [const(a) for a in node.args], {k.arg: const(k.value) for k in node.keywords}
    if _NOT_CONST in args or _NOT_CONST in kwargs.values():
        raise TestFormError(f"call {text[:80]!r}: arguments must be literals (numbers, strings, lists, dicts, ...)")
    return found[0], args, kwargs
