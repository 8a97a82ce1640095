"""Math answer verification: ``extract_answer`` and ``math_equal`` (public contracts).

Everything that grading does with a math answer runs in a forked worker (math.pool) under one
hard wall-clock limit (``reward.math_timeout_s``): ``check_response`` scans the response for its
final answer there (math.extract.final_answer, linear time: the last box, with the boxes joined to
it by connectives only, so ``\\boxed{1} or \\boxed{2}`` answers "1, 2"), then normalises and compares; ``check`` /
``math_equal`` normalise and compare an answer already extracted. A worker past the limit is
killed and replaced, and the answer is False (status "timeout").

Two backends (``reward.math_backend``), both in the same workers and limit:
- ``sympy`` (default): this package's rules below (math.normalize, math.parse, math.compare,
  math.symbolic);
- ``math_verify``: Hugging Face math-verify's ``parse`` + ``verify`` on the extracted answer and the
  reference (each wrapped in ``\\boxed{}``), with its own defaults and numeric rules; it misses
  ``1e3``-style numbers (reads ``1*E*3``). Its SIGALRM timeouts work here because each worker is
  the main thread of its own process. The answer is still the LAST box (extraction is ours).

Equivalence policy of the sympy backend:
- numbers are exact: integers and rationals compare as exact values, big ones included
  (``2^{64}-1`` != ``2^{64}``, ``100!+1`` != ``100!``); a decimal literal is exactly the rational its
  digits spell (``0.5`` = ``\\frac{1}{2}``, ``0.75\\pi`` = ``\\frac{3\\pi}{4}``, ``1e3`` = ``1000``);
  exact symbolic forms are equal when their difference is zero (SymPy exact arithmetic, simplify);
- the one tolerance: a decimal REFERENCE with >= 4 significant digits (``3.1416``, ``0.3333``,
  ``6.022 \\times 10^{23}``) stands for a rounded value, so a prediction that rounds or truncates
  to it at its last place is accepted (``\\pi`` for ``3.1416``, ``3.14159`` for ``3.1416``,
  ``\\frac{1}{3}`` for ``0.3333``). A decimal PREDICTION against an exact reference is only ever
  compared exactly: ``3.14159`` != ``\\pi``, ``1.414`` != ``\\sqrt{2}``, and ``0.333`` !=
  ``\\frac{1}{3}`` (the reference is exact and the decimal is another number); ``0.125`` =
  ``\\frac{1}{8}`` since that decimal terminates. Short decimal references are exact too
  (``0.13`` != ``0.125``);
- ``1,000`` = ``1\\,000`` = ``1000``; braces around the whole answer group nothing (``{42}`` =
  ``{{42}}`` = ``42``), but ``\\{1,2\\}`` is a set and ``{}`` the empty set;
- percent: ``50\\%`` = ``50`` = ``0.5`` (a sign on one side only allows both readings);
- degrees: ``30^\\circ`` = ``30`` = ``\\pi/6`` (same rule); units and ``\\text{}`` units dropped;
- equations: ``x=3`` = ``3``; sets and bare lists order-free; tuples ordered; intervals need the
  same brackets; ``a \\pm b`` = the list {a+b, a-b}; matrices entrywise;
- ``\\text{}`` words case/space-insensitive; choices by letter (``(B)`` = ``B`` = ``\\text{(B)}``);
- hedges are wrong: boxes joined by connectives are one list (``\\boxed{1} or \\boxed{2}``), several
  choices are no choice (``(B) or (C)``), an equation with disagreeing constant sides states nothing
  (``3 = 4``, ``x = 4 = 3``), ``3 4`` is no sum, and ``|x|`` != ``x`` (points of both signs);
- spellings: Unicode forms (``（Ｂ）``, ``½``, ``x²``), ``Infinity``, a lead-in (``The answer is 5``,
  ``答案是5``), ``x<-1 or x>3`` as a union, and a decimal comma (``3,5`` = ``3.5`` against one value).
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from megatron_rl.reward.math.compare import normalized_equal
from megatron_rl.reward.math.extract import extract_answer, final_answer
from megatron_rl.reward.math.normalize import normalize
from megatron_rl.reward.math.pool import WorkerPool

__all__ = ["extract_answer", "math_equal", "check", "check_response", "MathCheck", "equal_in_process",
           "close_pool", "warm_up", "BACKENDS"]

MAX_ANSWER_CHARS = 20_000
DEFAULT_TIMEOUT_S = 5.0
BACKENDS = ("sympy", "math_verify")


@dataclass(frozen=True)
class MathCheck:
    equal: bool
    status: str  # "ok", "identical", "too_long", "no_answer", "error", "timeout", "crash"
    seconds: float = 0.0
    error: str = ""
    prediction: str | None = None  # the extracted answer (check_response; None: no box)


def _math_verify_equal(prediction: str, reference: str, timeout: float) -> bool:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs whole inputs on timeouts
    seconds = max(1, int(timeout))  # its alarms take whole seconds; the pool's limit is the real one
    gold = parse("\\boxed{" + reference + "}", parsing_timeout=seconds)
    pred = parse("\\boxed{" + prediction + "}", parsing_timeout=seconds)
    return bool(verify(gold, pred, timeout_seconds=seconds))


def _decide(prediction: str, reference: str, backend: str, timeout: float) -> tuple[bool, str]:
    """(equal, status) of an extracted answer against the reference, in this process, no limit."""
    if len(prediction) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return prediction.strip() == reference.strip(), "too_long"  # no real answer is that long
    if backend == "math_verify":
        return _math_verify_equal(prediction, reference, timeout), "ok"
    pred, ref = normalize(prediction), normalize(reference)
    if pred == ref and pred.text:
        return True, "identical"
    if not pred.text or not ref.text:
        return False, "ok"
    return bool(normalized_equal(pred, ref)), "ok"


def _worker(kind: str, text: str, reference: str, backend: str, timeout: float):
    """Runs in a math.pool worker: (prediction, equal, status)."""
    # boxes offered together ("\\boxed{1} or \\boxed{2}") are one answer listing them, not the last
    prediction = final_answer(text) if kind == "response" else text
    if prediction is None:
        return None, False, "no_answer"
    return (prediction, *_decide(prediction, reference, backend, timeout))


_pools: dict[str, WorkerPool] = {}
_pool_lock = threading.Lock()


def _get_pool(backend: str) -> WorkerPool:
    """One pool per backend, each forked after its backend is imported (workers start warm)."""
    with _pool_lock:
        pool = _pools.get(backend)
        if pool is None:
            from megatron_rl.reward.math.symbolic import warm_up

            warm_up()  # import SymPy and build the LaTeX parser once, before the first fork
            if backend == "math_verify":
                import math_verify  # noqa: F401

            workers = int(os.environ.get("MEGATRON_RL_MATH_WORKERS", "2"))
            pool = _pools[backend] = WorkerPool(_worker, max_workers=max(1, workers))
        return pool


def warm_up(backend: str = "sympy") -> None:
    """Import the backend and build its pool now, so the first graded item does not pay for it."""
    if backend not in BACKENDS:
        raise ValueError(f"math backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    _get_pool(backend)


def close_pool() -> None:
    """Stop the idle math workers (they are also stopped at exit)."""
    with _pool_lock:
        for pool in _pools.values():
            pool.close()


def equal_in_process(prediction: str, reference: str, backend: str = "sympy") -> bool:
    """The same decision without a time limit (for trusted input and debugging only)."""
    _check_args(prediction, reference, DEFAULT_TIMEOUT_S, backend)
    return _decide(prediction, reference, backend, DEFAULT_TIMEOUT_S)[0]


def _check_args(text: str, reference: str, timeout: float, backend: str, name: str = "prediction") -> None:
    for what, value in ((name, text), ("reference", reference)):
        if not isinstance(value, str):
            raise TypeError(f"{what} must be str, got {type(value).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number > 0, got {timeout!r}")
    if backend not in BACKENDS:
        raise ValueError(f"math backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def _run(kind: str, text: str, reference: str, timeout: float, backend: str) -> MathCheck:
    result = _get_pool(backend).call((kind, text, reference, backend, timeout), timeout)
    if result.status != "ok":  # timeout, crash, or the worker raised: no verdict, not equal
        return MathCheck(False, result.status, result.seconds, result.error)
    prediction, equal, status = result.value
    return MathCheck(bool(equal), status, result.seconds, "", prediction)


def check(prediction: str, reference: str, timeout: float = DEFAULT_TIMEOUT_S,
          backend: str = "sympy") -> MathCheck:
    """``math_equal`` with the reason and the time taken."""
    _check_args(prediction, reference, timeout, backend)
    return _run("answer", prediction, reference, timeout, backend)


def check_response(response: str, reference: str, timeout: float = DEFAULT_TIMEOUT_S,
                   backend: str = "sympy") -> MathCheck:
    """Grade a whole response (or the part after ``</think>``): its last box against
    ``reference``, the scan included in the time limit. ``prediction`` is the extracted answer."""
    _check_args(response, reference, timeout, backend, name="response")
    return _run("response", response, reference, timeout, backend)


def math_equal(prediction: str, reference: str, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``prediction`` is mathematically equivalent to ``reference`` (False on timeout)."""
    return check(prediction, reference, timeout).equal
