"""The program reward.calls and reward.expand run inside the sandbox (copied to /box with plain.py):

    python -I /box/_call_runner.py calls    the candidate's functions on the calls of /box/calls.json
    python -s /box/_call_runner.py expand   test code that must run to give its values (no candidate)

Nothing here is trusted. In ``calls`` mode it shares its process with the candidate, which can read,
patch or replace all of it; the verifier never relies on it for more than carrying values: the calls
in (no expected value is ever written to the sandbox), the results out as plain data (reward.plain),
which the verifier decodes and compares itself. Its frames go to a private copy of fd 1 made before
the candidate's code runs; the candidate's own prints (fd 1) go to stderr. Frames, one JSON line each:

    {"loaded": true} | {"load_error": "SyntaxError", "message": "..."}       (calls)
    {"i": k, "value": <plain>} | {"i": k, "error": "ZeroDivisionError", "message": "..."}
    {"records": [...]} | {"error": "NameError: ...", "line": "<source line>"}  (expand)

``expand`` runs the rewritten test code of reward.asserts: every accepted assert calls
``__mrl__.call(k, *args, **kwargs).expect(expected, rel_tol, abs_tol, wrap_args)``, which records
those values; the function under test is a stub that refuses to be called. ``random`` is seeded with
0 (and the verifier sets PYTHONHASHSEED=0), so random tests expand the same in every worker.

Standard library only, and no import of megatron_rl: plain.py is loaded from its path.
"""
import importlib.util
import json
import os
import sys
import types

BOX = os.path.dirname(os.path.abspath(__file__))  # /box in the sandbox; the workspace when run bare
RECORDER = "__mrl__"  # = reward.asserts.RECORDER (this file imports nothing of megatron_rl)


def load_plain():
    spec = importlib.util.spec_from_file_location("_mrl_plain", f"{BOX}/_plain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def private_channel() -> int:
    """A copy of fd 1 for frames; fd 1 itself then points at stderr (prints cannot forge a frame line)."""
    out = os.dup(1)
    os.dup2(2, 1)
    return out


def send(fd: int, frame: dict) -> None:
    data = (json.dumps(frame, separators=(",", ":")) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def error_text(e: BaseException) -> str:
    try:
        return str(e)[:300]
    except BaseException:  # noqa: BLE001 -- a candidate's exception may break its own __str__
        return ""


def resolve(module, target: str):
    """The callable of a target: a function, or for "Class.method" the method of a fresh instance."""
    owner, _, method = target.partition(".")
    if not hasattr(module, owner):
        raise NameError(f"the solution defines no {owner!r}")
    fn = getattr(module, owner)
    return getattr(fn(), method) if method else fn


def run_calls(out: int, plain) -> None:
    with open(f"{BOX}/calls.json", encoding="utf-8") as f:
        calls = json.load(f)
    module = types.ModuleType("solution")
    module.__file__ = f"{BOX}/solution.py"
    sys.modules["solution"] = module
    try:
        with open(module.__file__, "rb") as f:  # bytes: decoded as `python solution.py` would (BOM, coding)
            exec(compile(f.read(), module.__file__, "exec"), module.__dict__)
    except BaseException as e:  # noqa: BLE001 -- SystemExit at load is a failed load too
        send(out, {"load_error": type(e).__name__, "message": error_text(e)})
        return
    send(out, {"loaded": True})
    for i, (target, args, kwargs) in enumerate(calls):
        try:
            result = resolve(module, target)(*plain.decode(args), **plain.decode(kwargs))
            frame = {"i": i, "value": plain.encode(result)}
        except plain.PlainError as e:
            frame = {"i": i, "error": "unsupported_result", "message": error_text(e)}
        except BaseException as e:  # noqa: BLE001 -- SystemExit, KeyboardInterrupt: a failed call
            frame = {"i": i, "error": type(e).__name__, "message": error_text(e)}
        send(out, frame)


class Stub:
    """The function under test during an expansion: any use other than an accepted assert is refused."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self.name!r} (the function under test) is called outside an accepted assert")


class Recorder:
    def __init__(self, plain):
        self.plain, self.records = plain, []

    def call(self, k, /, *args, **kwargs):
        record = {"k": k, "args": self.plain.encode(list(args)), "kwargs": self.plain.encode(kwargs)}

        def expect(expected, rel_tol, abs_tol, wrap_args):
            record.update(expected=self.plain.encode(expected), rel_tol=self.plain.encode(rel_tol),
                          abs_tol=self.plain.encode(abs_tol),
                          wrap_args=self.plain.encode([list(x) for x in wrap_args]))
            self.records.append(record)

        return types.SimpleNamespace(expect=expect)


def run_expansion(out: int, plain) -> None:
    import random

    with open(f"{BOX}/expansion.json", encoding="utf-8") as f:
        spec = json.load(f)
    random.seed(0)
    recorder = Recorder(plain)
    ns = {"__name__": "tests", RECORDER: recorder, **{name: Stub(name) for name in spec["targets"]}}
    try:
        exec(compile(spec["program"], "tests.py", "exec"), ns)
        if spec["check"]:
            ns[spec["check"]](Stub("candidate"))
        for name in spec["tests"]:
            ns[name]()
    except BaseException as e:  # noqa: BLE001 -- the test code's own failure, reported as such
        lines = spec["program"].splitlines()
        tb = e.__traceback__
        lineno = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == "tests.py":
                lineno = tb.tb_lineno
            tb = tb.tb_next
        line = lines[lineno - 1].strip() if lineno and lineno <= len(lines) else ""
        send(out, {"error": f"{type(e).__name__}: {error_text(e)}", "line": line})
        return
    send(out, {"records": recorder.records})


def main() -> None:
    out = private_channel()
    plain = load_plain()
    run_calls(out, plain) if sys.argv[1:] == ["calls"] else run_expansion(out, plain)
    os._exit(0)  # no interpreter teardown: the verifier has every frame it needs


if __name__ == "__main__":
    main()
