"""Running assert code that needs running (reward.call_types.Expansion) to get its calls and expected
values: in the sandbox, WITHOUT the candidate's code (reward.call_runner ``expand``).

The test code comes with the data, not from the model, so what it computes is trusted like the data
itself; it still runs jailed (a problem file can hold anything). ``random`` is seeded and
PYTHONHASHSEED fixed, so every verifier process expands a random test the same way, and each process
keeps the result (`expand_suite` caches per Expansion). A failure of the test code is the data's fault:
TestFormError with the line (no verdict on the candidate); a sandbox that cannot run is
`ExpansionUnavailable`.
"""
from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.reward import plain
from megatron_rl.reward.asserts import build_test, tolerances
from megatron_rl.reward.call_types import CallSuite, CallTest, Expansion, TestFormError
from megatron_rl.reward.code import CodeLimits, Toolchain, classify, rlimits, write_file
from megatron_rl.reward.sandbox import BOX, Jail

RUNNER = Path(__file__).with_name("call_runner.py")
PLAIN = Path(__file__).with_name("plain.py")
MAX_OUTPUT = 16 << 20  # the records of a long random test (HumanEval/53: 105 calls) stay far below
_CACHE: dict[Expansion, tuple[CallTest, ...]] = {}
_CACHE_SIZE = 512


class ExpansionUnavailable(RuntimeError):
    """The sandbox could not run the test code (the program never ran)."""


def copy_runner(ws: str) -> None:
    """The runner and the plain-data codec, into a workspace (/box/_call_runner.py, /box/_plain.py)."""
    write_file(ws, "_call_runner.py", RUNNER.read_text(encoding="utf-8"))
    write_file(ws, "_plain.py", PLAIN.read_text(encoding="utf-8"))


def expand_suite(suite: CallSuite, jail: Jail, tc: Toolchain, lim: CodeLimits) -> list[CallTest]:
    """Every CallTest of the suite, in order, expansions run (or taken from this process's cache)."""
    tests: list[CallTest] = []
    for part in suite.parts:
        if isinstance(part, Expansion):
            if part not in _CACHE:
                if len(_CACHE) >= _CACHE_SIZE:
                    _CACHE.clear()
                _CACHE[part] = _expand(part, jail, tc, lim)
            part = _CACHE[part]
        tests += part
    return tests


def _expand(exp: Expansion, jail: Jail, tc: Toolchain, lim: CodeLimits) -> tuple[CallTest, ...]:
    spec = {"program": exp.program, "targets": list(exp.targets), "check": exp.check, "tests": list(exp.test_functions)}
    with jail.workspace() as ws:
        copy_runner(ws)
        write_file(ws, "expansion.json", json.dumps(spec))
        out = jail.run(["/usr/bin/env", "PYTHONHASHSEED=0", tc.python, "-s", f"{BOX}/_call_runner.py", "expand"],
                       rlimits=rlimits(lim, lim.compile_timeout_s, lim.memory_mb, lim.fsize_mb),
                       wall_s=lim.compile_timeout_s, max_output=MAX_OUTPUT, workspace=ws)
    if out.setup_error is not None:
        raise ExpansionUnavailable(out.setup_error)
    line = out.stdout.split(b"\n", 1)[0]
    try:
        frame = json.loads(line)
    except ValueError:
        why = classify(out) or "no result"
        tail = out.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise TestFormError(f"running the test code failed ({why}): {tail[0][:200]}") from None
    if "error" in frame:
        raise TestFormError(f"the test code raised {frame['error'][:200]} at `{frame.get('line', '')[:120]}`")
    return tuple(_test(exp, r) for r in frame["records"])


def _test(exp: Expansion, record: dict) -> CallTest:
    form = exp.forms[record["k"]]
    wrap_args = plain.decode(record["wrap_args"])
    tols = tolerances(form.tolerance, plain.decode(record["rel_tol"]), plain.decode(record["abs_tol"]))
    expected = None if form.op == "returns" else plain.decode(record["expected"])
    return build_test(form.target, form.op, plain.decode(record["args"]), plain.decode(record["kwargs"]),
                      expected, tols, list(zip(form.wraps, wrap_args)), form.source)
