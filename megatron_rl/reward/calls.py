"""Function-call tests graded in the sandbox: one path for the training reward (reward.score), HumanEval
evaluation (data.humaneval) and tools (a multi-turn environment can call `run_call_tests` directly).

``run_call_tests(code, tests, entry_point=None, limits=None, toolchain=None, **overrides) -> CodeResult``

All tests of a problem run in ONE sandboxed process (reward.call_runner): it loads the candidate's
code, then makes each call and sends back the result as plain data (reward.plain), one frame per
call. The verdict is formed here, outside the sandbox, and rests on nothing the candidate controls
but its results:
- expected values never enter the sandbox (it gets the calls only), so no file, variable or frame of
  the candidate's process holds them;
- results are decoded into fresh built-in values and compared here (reward.compare), so an object
  whose ``__eq__`` says True, a patched builtin or module, a fake "passed" print, or an exit status
  count for nothing: a result that is not plain data fails its test;
- each call has its own time limit, kept here (a fresh deadline per frame: an alarm inside the
  sandbox could be cancelled by the candidate); a call past it is "timeout", and the process is
  killed;
- a result that never arrives fails: a process that ends early (sys.exit, os._exit, a signal, a
  crash) or is killed for a limit fails the call in flight and every call after it ("not_run").

Grading is partial: every test gets a status (``test_statuses``) and ``n_passed`` counts the ones that
passed; ``passed`` (the reward's "correct") needs all of them. Statuses: ok, wrong_answer (a wrong or
non-plain result), runtime_error (the call raised), memory (MemoryError), timeout, output_limit (the
results and prints of the process passed max_output_bytes), not_run; for the whole program:
compile_error (a syntax error), runtime_error (loading it raised), sandbox_unavailable.
Limits: CodeLimits (test_timeout_s per call and for loading the code, memory_mb for the process and
any children it forks together, max_tests calls at most, CPU time (max_tests + 1) x test_timeout_s in
all, and total_timeout_s of wall clock for the whole grading, test code expansion included: past it the
call in flight is "timeout"). The solution is compiled from its file's bytes, as ``python solution.py``
reads it (a BOM, a coding line; invalid UTF-8 is a compile_error).
"""
from __future__ import annotations

import json
import math
import time
from typing import Any

from megatron_rl.reward import plain
from megatron_rl.reward.call_tests import parse_call_tests
from megatron_rl.reward.call_types import CallSuite, CallTest, TestFormError
from megatron_rl.reward.code import (
    SANDBOX_UNAVAILABLE, CodeLimits, CodeResult, Toolchain, classify, limits_with, rlimits, sandbox_for,
    wall_left, write_file,
)
from megatron_rl.reward.compare import check_result, describe
from megatron_rl.reward.expand import ExpansionUnavailable, copy_runner, expand_suite
from megatron_rl.reward.sandbox import BOX, Jail, RunOutcome
from megatron_rl.reward.sandbox_proc import STOP

_SYNTAX = ("SyntaxError", "IndentationError", "TabError")


class FrameReader:
    """Watches the runner's stdout (sandbox_proc.collect's on_stdout): splits it into frames, gives
    each call a fresh deadline when the previous frame is complete, and stops the run once the load
    frame and every result are in (no waiting for the candidate's exit)."""

    def __init__(self, n_calls: int, timeout_s: float, end: float = math.inf):
        self.n_frames, self.timeout_s, self.end = n_calls + 1, timeout_s, end  # end: the grading deadline
        self.frames: list[bytes] = []
        self.times: list[float] = []  # seconds from the previous frame to each frame
        self.buf = bytearray()
        self.last = time.perf_counter()

    def __call__(self, chunk: bytes) -> float | None:
        self.buf += chunk
        if b"\n" not in chunk:
            return None  # a partial frame buys no time
        *lines, rest = bytes(self.buf).split(b"\n")
        self.buf = bytearray(rest)
        now = time.perf_counter()
        for line in lines:
            self.frames.append(line)
            self.times.append(now - self.last)
            self.last = now
        return STOP if len(self.frames) >= self.n_frames else min(now + self.timeout_s, self.end)


def run_call_tests(code: str, tests: Any, entry_point: str | None = None, limits: CodeLimits | None = None,
                   toolchain: Toolchain | None = None, **overrides) -> CodeResult:
    """Grade Python ``code`` on function-call tests (a CallSuite, or tests in any form reward.call_tests
    accepts); ``overrides`` are CodeLimits fields. TestFormError for tests that cannot be graded."""
    t0 = time.perf_counter()
    if not isinstance(code, str):
        raise ValueError(f"code must be str, got {type(code).__name__}")
    suite = tests if isinstance(tests, CallSuite) else parse_call_tests(tests, entry_point)
    lim, tc = limits_with(limits, overrides), toolchain or Toolchain()
    jail, sandboxed, why = sandbox_for(tc, "python", lim)
    calls: list[CallTest] = []
    if jail is not None:
        try:
            calls = expand_suite(suite, jail, tc, lim)[: lim.max_tests]
        except ExpansionUnavailable as e:
            jail, why = None, str(e)
        if jail is not None and not calls:  # nothing to pass would pass anything
            raise TestFormError("the tests make no call of the function (a loop that never ran?)")
    if jail is None:
        return CodeResult(False, 0, 0, SANDBOX_UNAVAILABLE, "python", message=why,
                          total_s=time.perf_counter() - t0)
    result = _grade(code, calls, jail, tc, lim, lim.deadline(t0))
    result.sandboxed, result.total_s = sandboxed, time.perf_counter() - t0
    return result


def _grade(code: str, calls: list[CallTest], jail: Jail, tc: Toolchain, lim: CodeLimits,
           end: float = math.inf) -> CodeResult:
    reader = FrameReader(len(calls), lim.test_timeout_s, end)
    with jail.workspace() as ws:
        copy_runner(ws)
        write_file(ws, "solution.py", code)
        write_file(ws, "calls.json", json.dumps([[c.target, plain.encode(list(c.args)), plain.encode(c.kwargs)]
                                                 for c in calls]))
        cpu_s = math.ceil(lim.test_timeout_s) * (len(calls) + 1)
        out = jail.run([tc.python, "-I", f"{BOX}/_call_runner.py", "calls"],
                       rlimits=rlimits(lim, cpu_s, lim.memory_mb, lim.fsize_mb),
                       wall_s=wall_left(lim.test_timeout_s, end),
                       max_output=lim.max_output_bytes, workspace=ws, on_stdout=reader)
    if out.setup_error is not None:
        return CodeResult(False, 0, len(calls), SANDBOX_UNAVAILABLE, "python", message=out.setup_error)
    load = _load_status(reader.frames[0] if reader.frames else None, out)
    if load is not None:
        status, message = load
        return CodeResult(False, 0, len(calls), status, "python", first_failed=0, message=message,
                          test_statuses=[status] * len(calls))
    verdicts = [_verdict(i, c, line) for i, (c, line) in enumerate(zip(calls, reader.frames[1:]))]
    if len(verdicts) < len(calls):  # the call in flight when the process ended or was killed; the rest never ran
        verdicts.append(_ended(out))
        verdicts += [("not_run", "")] * (len(calls) - len(verdicts))
    return _result(calls, verdicts, reader.times[1:])


def _ended(out: RunOutcome) -> tuple[str, str]:
    """Status and message of the frame that never came: the run was killed for a limit or ended."""
    status = classify(out) or "runtime_error"
    tail = out.stderr.decode("utf-8", errors="replace").strip()[-300:]
    return status, f"no result: the process {'was stopped' if status != 'runtime_error' else 'ended'} " \
                   f"({status}, exit {out.exit_code}) {tail}".strip()


def _frame(line: bytes) -> dict | None:
    try:
        frame = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return frame if isinstance(frame, dict) else None


def _load_status(line: bytes | None, out: RunOutcome) -> tuple[str, str] | None:
    """None when the code loaded; else the status of every test and why."""
    if line is None:
        return _ended(out)
    frame = _frame(line)
    if frame == {"loaded": True}:
        return None
    if frame is None or not isinstance(frame.get("load_error"), str):
        return "runtime_error", "the first frame is no load report"
    kind = "compile_error" if frame["load_error"] in _SYNTAX else "runtime_error"
    return kind, f"loading the code raised {frame['load_error']}: {str(frame.get('message', ''))[:300]}"


def _verdict(i: int, test: CallTest, line: bytes) -> tuple[str, str]:
    """(status, message) of call ``i`` from its frame."""
    frame = _frame(line)
    if frame is None or frame.get("i") != i or ("value" in frame) == ("error" in frame):
        return "runtime_error", f"result {i}: not a valid frame"
    if "error" in frame:
        err, msg = str(frame["error"]), str(frame.get("message", ""))[:300]
        if err == "unsupported_result":
            return "wrong_answer", f"the result is not plain data ({msg})"
        return ("memory" if err == "MemoryError" else "runtime_error"), f"raised {err}: {msg}"
    try:
        got = plain.decode(frame["value"])
    except plain.PlainError as e:
        return "wrong_answer", f"the result is not plain data ({e})"
    ok, why = check_result(got, test.op, test.expected, test.rel_tol, test.abs_tol, test.wraps)
    return ("ok", "") if ok else ("wrong_answer", why)


def _result(calls: list[CallTest], verdicts: list[tuple[str, str]], times: list[float]) -> CodeResult:
    statuses = [s for s, _ in verdicts]
    failed = next((i for i, s in enumerate(statuses) if s != "ok"), None)
    status = "ok" if failed is None else statuses[failed]
    message = "" if failed is None else f"test {failed} `{calls[failed].source[:160]}`: {verdicts[failed][1]}"
    return CodeResult(failed is None, statuses.count("ok"), len(calls), status, "python", first_failed=failed,
                      message=message[:600], test_s=times[:len(calls)], test_statuses=statuses)
