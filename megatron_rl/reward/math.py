"""Math answer verification: ``extract_answer`` and ``math_equal`` (public contracts).

``math_equal(prediction, reference, timeout)`` normalises both answers in this process (linear
string work only), then parses and compares them in a forked worker (math_pool) under a hard
wall-clock limit: a worker that runs past ``timeout`` is killed and replaced and the answer is
False. Only two things are decided here without a worker: identical normalised strings (True)
and answers over ``MAX_ANSWER_CHARS`` (False: no real answer is that long).

Equivalence policy (details in math_compare / math_sympy):
- numbers: ``1,000`` = ``1\\,000`` = ``1000``; ``\\frac{1}{2}`` = ``0.5`` = ``1/2``; ``1e3`` =
  ``1 \\times 10^{3}``; exact values agree to 1e-10 relative; a decimal with >= 4 significant
  digits matches an exact non-terminating value it rounds/truncates to (``0.3333`` ~ ``1/3``),
  two terminating values must be exactly equal (``0.5`` != ``0.05``, ``0.125`` != ``0.13``);
- expressions: exact SymPy equality, else numeric evaluation at random points, else simplify;
- percent: ``50\\%`` = ``50`` = ``0.5`` (a sign on one side only allows both readings);
- degrees: ``30^\\circ`` = ``30`` = ``\\pi/6`` (same rule); units and ``\\text{}`` units dropped;
- equations: ``x=3`` = ``3``; sets and bare lists order-free; tuples ordered; intervals need the
  same brackets; ``a \\pm b`` = the list {a+b, a-b}; matrices entrywise;
- ``\\text{}`` words case/space-insensitive; choices by letter (``(B)`` = ``B`` = ``\\text{(B)}``).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from megatron_rl.reward.math_compare import normalized_equal
from megatron_rl.reward.math_extract import extract_answer
from megatron_rl.reward.math_normalize import Normalized, normalize
from megatron_rl.reward.math_pool import WorkerPool

__all__ = ["extract_answer", "math_equal", "check", "MathCheck", "equal_in_process", "close_pool"]

MAX_ANSWER_CHARS = 20_000
DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class MathCheck:
    equal: bool
    status: str  # "ok", "identical", "too_long", "error", "timeout", "crash"
    seconds: float = 0.0
    error: str = ""


def _compare_worker(pred: Normalized, ref: Normalized) -> bool:
    return bool(normalized_equal(pred, ref))


_pool: WorkerPool | None = None
_pool_lock = threading.Lock()


def _get_pool() -> WorkerPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            from megatron_rl.reward.math_sympy import warm_up

            warm_up()  # import SymPy and build the LaTeX parser once, before the first fork

            workers = int(os.environ.get("MEGATRON_RL_MATH_WORKERS", "2"))
            _pool = WorkerPool(_compare_worker, max_workers=max(1, workers))
        return _pool


def close_pool() -> None:
    """Stop the idle math workers (they are also stopped at exit)."""
    with _pool_lock:
        if _pool is not None:
            _pool.close()


def equal_in_process(prediction: str, reference: str) -> bool:
    """The same decision without a time limit (for trusted input and debugging only)."""
    return normalized_equal(normalize(prediction), normalize(reference))


def check(prediction: str, reference: str, timeout: float = DEFAULT_TIMEOUT_S) -> MathCheck:
    """``math_equal`` with the reason and the time taken."""
    for name, value in (("prediction", prediction), ("reference", reference)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be str, got {type(value).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    if len(prediction) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return MathCheck(prediction.strip() == reference.strip(), "too_long")
    pred, ref = normalize(prediction), normalize(reference)
    if pred == ref and pred.text:
        return MathCheck(True, "identical")
    if not pred.text or not ref.text:
        return MathCheck(False, "ok")
    result = _get_pool().call((pred, ref), timeout)
    return MathCheck(result.status == "ok" and bool(result.value), result.status, result.seconds,
                     result.error)


def math_equal(prediction: str, reference: str, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``prediction`` is mathematically equivalent to ``reference`` (False on timeout)."""
    return check(prediction, reference, timeout).equal
