"""Verifier pool: grade many responses in parallel worker processes.

Each worker is a fresh (spawned) Python process in its own process group that grades one item at a
time. The parent hands an item to an idle worker and watches two things:
- a per-item deadline (RewardConfig.verifier_item_timeout_s): past it, the worker's whole process
  group is killed, the item gets status "timeout" with total 0, and a new worker is started;
  a hung item is never re-issued (it would hang again) and never blocks the others;
- the worker itself: if it dies (crash, OOM kill, kill -9), its item is re-issued to another
  worker up to ``max_retries`` times, then gets status "crash"; the worker is restarted.
An exception raised by the grading function gives status "error" (total 0, message in ``error``).
Every status but "ok" (these three, and score's "sandbox_unavailable") is a grading failure
(``RewardBreakdown.grading_failed``): its total 0 is no reward, and callers must not train on it.
Timings: every breakdown carries ``elapsed_s`` (time in the grader); ``last_stats`` sums up a call.

Spawned workers re-import the parent's main module under the name ``__mp_main__``: scripts that
use the pool need the usual ``if __name__ == "__main__":`` guard.
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Callable, Iterable, Sequence

from megatron_rl.config import RewardConfig
from megatron_rl.reward.compose import penalty_window
from megatron_rl.reward.grade import score
from megatron_rl.reward.types import GradeStatus, RewardBreakdown, ScoreItem, TaskError, parse_task

# fn(task, response, config, num_tokens[, stage= | l_max=, l_cache=]) -> RewardBreakdown; the keywords
# are passed only for items that carry their own overlong-penalty window: a ScoreItem's length stage,
# or a dict item's l_max / l_cache.
GradeFn = Callable[..., RewardBreakdown]


@dataclass
class PoolStats:
    n_items: int = 0
    wall_s: float = 0.0
    grade_s_total: float = 0.0  # sum of per-item grading time (parallelism = grade_s_total / wall_s)
    grade_s_max: float = 0.0
    items_per_s: float = 0.0
    n_timeout: int = 0
    n_crash: int = 0
    n_error: int = 0
    n_failed: int = 0  # items without a verdict: every status but "ok"
    worker_restarts: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


def _worker_main(conn, fn: GradeFn, config: RewardConfig) -> None:
    """Worker loop: ready, then (index, task, response, num_tokens, window) -> (index, breakdown | error)."""
    os.setpgid(0, 0)  # own process group: a timeout kills the worker and whatever it started
    try:  # warm up the language model so the first item's deadline is not spent loading it
        from megatron_rl.reward.language import _get_model

        _get_model()
    except Exception:  # grading will raise the real error item by item
        pass
    try:  # and the math checker (SymPy / math-verify imported, its workers forked from here)
        from megatron_rl.reward.math import warm_up

        warm_up(config.math_backend)
    except Exception:
        pass
    if config.custom:  # and the reward plug-in (its import errors show on each item as status "error")
        try:
            from megatron_rl.reward.custom import load_reward_fn

            load_reward_fn(config.custom)
        except Exception:
            pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if msg is None:
            return
        index, task, response, num_tokens, window = msg
        start = time.perf_counter()
        try:
            result = fn(task, response, config, num_tokens, **window)
            result.elapsed_s = time.perf_counter() - start
            conn.send((index, result, None))
        except Exception as e:  # reported as status "error" for this item only
            conn.send((index, None, f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx, fn: GradeFn, config: RewardConfig):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, fn, config), name="verifier")
        self.proc.start()
        child.close()
        self.ready = False
        self.item: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        for target in (lambda: os.killpg(self.proc.pid, signal.SIGKILL), self.proc.kill):
            try:
                target()
            except (ProcessLookupError, PermissionError, OSError):
                pass
        self.proc.join(5)
        self.conn.close()


def _normalise(item: Any, index: int, config: RewardConfig) -> tuple[Any, str, int | None, dict[str, Any]]:
    window: dict[str, Any] = {}
    if isinstance(item, ScoreItem):
        task, response, num_tokens = item.task, item.response, item.num_tokens
        window = {} if item.stage is None else {"stage": item.stage}
    elif isinstance(item, dict):
        task, response, num_tokens = item.get("task"), item.get("response"), item.get("num_tokens")
        window = {k: item[k] for k in ("l_max", "l_cache") if item.get(k) is not None}
    elif isinstance(item, (tuple, list)) and len(item) in (2, 3):
        task, response, num_tokens = item[0], item[1], item[2] if len(item) == 3 else None
    else:
        raise TaskError(f"item {index}: expected a ScoreItem, (task, response[, num_tokens]) or a dict with "
                        f"those keys (plus optional l_max, l_cache)")
    try:  # a missing or bad window is the caller's bug: fail the call, not the item
        penalty_window(config, **window)
    except ValueError as e:
        raise TaskError(f"item {index}: {e}") from None
    try:
        parsed = parse_task(task)
    except TaskError as e:
        raise TaskError(f"item {index}: {e}") from None
    if not isinstance(response, str):
        raise TaskError(f"item {index}: response must be a string, got {type(response).__name__}")
    # a dict goes as given: a reward.custom plug-in sees its id, source and meta too
    return (task if isinstance(task, dict) else parsed), response, num_tokens, window


class VerifierPool:
    """Parallel grading with per-item timeouts and crash recovery; use as a context manager."""

    def __init__(self, config: RewardConfig | None = None, workers: int | None = None,
                 item_timeout_s: float | None = None, fn: GradeFn = score, max_retries: int = 1,
                 start_method: str = "spawn"):
        self.config = config if config is not None else RewardConfig()
        self.n_workers = workers if workers is not None else self.config.verifier_workers
        self.item_timeout_s = item_timeout_s if item_timeout_s is not None else self.config.verifier_item_timeout_s
        if self.n_workers < 1 or self.item_timeout_s <= 0 or max_retries < 0:
            raise ValueError("need workers >= 1, item_timeout_s > 0, max_retries >= 0")
        self.fn, self.max_retries = fn, max_retries
        if self.config.custom:  # a plug-in that cannot load fails here, once, not on every item
            from megatron_rl.reward.custom import load_reward_fn

            load_reward_fn(self.config.custom)
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self.restarts = 0
        self._start_failures = 0  # workers that died before becoming ready, in a row
        self.last_stats = PoolStats()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "VerifierPool":
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self._ctx, self.fn, self.config))
        return self

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.proc.join(2)
            w.kill()
        self._workers = []

    def __enter__(self) -> "VerifierPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """PIDs of the live workers (tests kill one to check recovery)."""
        return [w.proc.pid for w in self._workers if w.proc.is_alive()]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until every worker has started (imports done, language model loaded)."""
        self.start()
        end = time.monotonic() + timeout
        while not all(w.ready for w in self._workers):
            pending = [w for w in self._workers if not w.ready]
            if time.monotonic() > end:
                raise TimeoutError(f"{len(pending)} verifier worker(s) not ready after {timeout} s")
            for conn in wait([w.conn for w in pending] + [w.proc.sentinel for w in pending], 0.5):
                w = next(w for w in pending if conn in (w.conn, w.proc.sentinel))
                self._on_ready_or_dead(w)

    def _on_ready_or_dead(self, w: _Worker) -> None:
        try:
            if w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready = True
                    return
        except (EOFError, OSError):
            pass
        if not w.proc.is_alive():
            self._replace(w)

    def _replace(self, w: _Worker) -> None:
        self._start_failures = 0 if w.ready else self._start_failures + 1
        if self._start_failures > 3 * self.n_workers:
            raise RuntimeError(f"verifier workers keep dying before they are ready (exit code "
                               f"{w.proc.exitcode}); run `python -c 'import megatron_rl.reward'` to see why")
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self.fn, self.config)
        self.restarts += 1

    # ---------------------------------------------------------------- grading
    def map(self, items: Iterable[Any]) -> list[RewardBreakdown]:
        """Grade items (ScoreItem, whose `stage` is the length stage the response was generated under;
        (task, response[, num_tokens]); or dicts, which may add the overlong-penalty window ``l_max`` /
        ``l_cache``); results in input order."""
        batch = [_normalise(item, i, self.config) for i, item in enumerate(items)]
        self.start()
        start, restarts0 = time.perf_counter(), self.restarts
        results: list[RewardBreakdown | None] = [None] * len(batch)
        attempts = [0] * len(batch)
        queue = collections.deque(range(len(batch)))
        done = 0
        while done < len(batch):
            now = time.monotonic()
            for w in self._workers:  # dispatch to idle, ready workers
                if w.ready and w.item is None and queue:
                    w.item = queue.popleft()
                    attempts[w.item] += 1
                    w.deadline = now + self.item_timeout_s
                    task, response, num_tokens, window = batch[w.item]
                    try:
                        w.conn.send((w.item, task, response, num_tokens, window))
                    except (OSError, ValueError):
                        pass  # dead worker: its sentinel fires below
            busy = [w.deadline for w in self._workers if w.item is not None]
            timeout = max(0.0, min(busy) - now) if busy else 0.5
            handles = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
            ready = wait(handles, timeout)
            for w in list(self._workers):
                if w.conn in ready or w.proc.sentinel in ready:
                    done += self._collect(w, results, attempts, queue)
            now = time.monotonic()
            for w in list(self._workers):
                if w.item is not None and now >= w.deadline:
                    results[w.item] = RewardBreakdown(
                        status=GradeStatus.TIMEOUT, elapsed_s=self.item_timeout_s,
                        error=f"grading exceeded the per-item limit of {self.item_timeout_s:g} s")
                    done += 1
                    self._replace(w)
        self.last_stats = self._stats(results, time.perf_counter() - start, self.restarts - restarts0)
        return results  # type: ignore[return-value]

    def _collect(self, w: _Worker, results, attempts, queue) -> int:
        """Read one message or handle a dead worker; returns how many items finished."""
        try:
            if w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready = True
                    return 0
                index, result, error = msg
                if index != w.item:  # a late answer for an item already decided: ignore
                    return 0
                w.item = None
                results[index] = result if error is None else RewardBreakdown(status=GradeStatus.ERROR, error=error)
                return 1
        except (EOFError, OSError):
            pass
        if w.proc.is_alive():
            return 0
        index, code = w.item, w.proc.exitcode
        self._replace(w)
        if index is None:
            return 0
        if attempts[index] <= self.max_retries:
            queue.appendleft(index)  # re-issue the item to the next idle worker
            return 0
        results[index] = RewardBreakdown(
            status=GradeStatus.CRASH, error=f"verifier worker died (exit code {code}) on all {attempts[index]} attempts")
        return 1

    @staticmethod
    def _stats(results: Sequence[RewardBreakdown | None], wall: float, restarts: int) -> PoolStats:
        by_status = collections.Counter(r.status for r in results if r is not None)
        grade = [r.elapsed_s for r in results if r is not None]
        return PoolStats(n_items=len(results), wall_s=wall, grade_s_total=sum(grade),
                         grade_s_max=max(grade, default=0.0), items_per_s=len(results) / wall if wall else 0.0,
                         n_timeout=by_status["timeout"], n_crash=by_status["crash"], n_error=by_status["error"],
                         n_failed=sum(n for status, n in by_status.items() if status != "ok"),
                         worker_restarts=restarts, by_status=dict(by_status))


def score_batch(items: Iterable[Any], config: RewardConfig | None = None, workers: int | None = None,
                item_timeout_s: float | None = None) -> list[RewardBreakdown]:
    """Grade many items in a temporary VerifierPool (keep a VerifierPool to reuse its workers)."""
    with VerifierPool(config, workers=workers, item_timeout_s=item_timeout_s) as pool:
        return pool.map(items)
