"""A small pool of forked worker processes that runs a function under a hard wall-clock limit.

The limit is enforced from outside: the parent waits on the worker's pipe with ``select``; a worker
that is late is SIGKILLed and reaped, and a fresh one is forked on the next call. Workers are raw
``os.fork`` children (not multiprocessing), so the pool also works inside daemonic multiprocessing
workers, and they inherit the parent's imports (SymPy is imported once, before the first fork).
Each worker gets an address-space limit (current size + ``memory_mb``) so ``(10^9)!`` fails fast
with MemoryError instead of swapping. A worker exits when its request pipe closes (the parent
closed the pool or died); as a backstop for a parent that dies mid-call, each request also lowers
the worker's RLIMIT_CPU to its CPU time so far + 2 x timeout + 5 s (SIGXCPU ends it). No
PR_SET_PDEATHSIG: it fires when the forking *thread* exits, which would kill workers of a pool
shared by threads. Each child closes every inherited descriptor except its own pipe ends, so a
sibling's pipe is never held open by another worker (EOF = crash stays detectable).
"""
from __future__ import annotations

import atexit
import math
import os
import pickle
import resource
import select
import signal
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

_HEADER = struct.Struct("!Q")


@dataclass(frozen=True)
class CallResult:
    status: str  # "ok", "error" (the function raised), "timeout", "crash" (worker died)
    value: Any = None
    error: str = ""
    seconds: float = 0.0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _readable(fd: int, timeout_s: float) -> bool:
    """poll, not select: select() refuses descriptors >= FD_SETSIZE (1024), which a long-lived
    process (a controller with loggers, servers and pools) can reach."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, int(timeout_s * 1000 + 0.999))))


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from fd, or None on EOF; raises TimeoutError past the deadline."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(fd, left):
                raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(fd: int, deadline: float | None):
    head = _read_exact(fd, _HEADER.size, deadline)
    if head is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(head)[0], deadline)
    return None if body is None else pickle.loads(body)


def _encode(obj) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _send(fd: int, obj) -> None:
    _write_all(fd, _encode(obj))


def _vm_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _child_main(func: Callable, rfd: int, wfd: int, memory_mb: int | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    signal.signal(signal.SIGXCPU, signal.SIG_DFL)
    for lo, hi in ((3, min(rfd, wfd)), (min(rfd, wfd) + 1, max(rfd, wfd)), (max(rfd, wfd) + 1, 1 << 16)):
        os.closerange(lo, hi)
    if memory_mb:
        limit = _vm_bytes() + memory_mb * (1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ValueError, OSError):
            pass
    while True:
        try:
            args = _recv(rfd, None)
        except OSError:  # the request pipe broke: the parent is gone; anything else ends in _Worker's guard
            return
        if args is None:
            return
        budget, args = args
        _limit_cpu(budget)
        try:  # encoded here, so a result that cannot be pickled is reported as the call's error too
            reply = _encode(("ok", func(*args)))
        except BaseException as exc:  # MemoryError, RecursionError, parser errors: all reported
            reply = _encode(("error", f"{type(exc).__name__}: {str(exc)[:200]}"))
        try:
            _write_all(wfd, reply)
        except OSError:  # the parent closed the pipe (it discarded this worker, or exited): no one to tell
            return


def _limit_cpu(budget: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + budget)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    except (ValueError, OSError):
        pass


class _Worker:
    def __init__(self, func: Callable, memory_mb: int | None):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                os.close(to_child_w)
                os.close(from_child_r)
                _child_main(func, to_child_r, from_child_w, memory_mb)
            except BaseException:  # a fork must never unwind into the parent's code: the parent sees EOF ("crash")
                code = 1
            finally:
                os._exit(code)
        os.close(to_child_r)
        os.close(from_child_w)
        self.pid, self.wfd, self.rfd = pid, to_child_w, from_child_r

    def kill(self) -> None:
        for fd in (self.wfd, self.rfd):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


class WorkerPool:
    """Runs ``func(*args)`` in forked workers with a per-call time limit (see module doc)."""

    def __init__(self, func: Callable, max_workers: int = 2, memory_mb: int | None = 2048):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.func, self.max_workers, self.memory_mb = func, max_workers, memory_mb
        self._reset()
        _POOLS.add(self)

    def _reset(self) -> None:
        self._owner = os.getpid()
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._alive = 0
        self.n_killed = 0

    def _acquire(self) -> _Worker | None:
        with self._cond:
            if self._owner != os.getpid():  # we are a fork of the pool's owner: its workers are not ours
                self._reset()
                return self._acquire()
            while not self._idle and self._alive >= self.max_workers:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._alive += 1
        return None  # the caller forks a new worker outside the lock

    def _release(self, worker: _Worker | None) -> None:
        with self._cond:
            if worker is None:
                self._alive -= 1
            else:
                self._idle.append(worker)
            self._cond.notify()

    def call(self, args: tuple, timeout: float) -> CallResult:
        """Run ``func(*args)`` in a worker; a call past ``timeout`` seconds kills that worker."""
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        worker = self._acquire()
        if worker is None:
            try:
                worker = _Worker(self.func, self.memory_mb)
            except BaseException:  # fork failed: give the reserved worker slot back, then re-raise
                self._release(None)
                raise
        start = time.monotonic()
        try:
            _send(worker.wfd, (2 * timeout + 5, args))
            reply = _recv(worker.rfd, start + timeout)
        except TimeoutError:
            return self._discard(worker, CallResult("timeout", seconds=time.monotonic() - start))
        except (OSError, EOFError, pickle.PickleError):
            reply = None
        except BaseException:
            self._discard(worker, None)  # KeyboardInterrupt mid-call: the worker state is unknown
            raise
        if reply is None:
            return self._discard(worker, CallResult("crash", seconds=time.monotonic() - start))
        self._release(worker)
        status, payload = reply
        seconds = time.monotonic() - start
        if status == "ok":
            return CallResult("ok", value=payload, seconds=seconds)
        return CallResult("error", error=payload, seconds=seconds)

    def _discard(self, worker: _Worker, result: CallResult | None) -> CallResult | None:
        worker.kill()
        self.n_killed += 1
        self._release(None)
        return result

    def close(self) -> None:
        """Stop every idle worker (busy ones are stopped by their caller's time limit)."""
        with self._cond:
            if self._owner != os.getpid():
                self._reset()
                return
            idle, self._idle = self._idle, []
            self._alive -= len(idle)
        for w in idle:
            w.kill()


_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()
