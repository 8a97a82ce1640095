"""math.pool.WorkerPool: the time limit is enforced from outside, late or crashed workers are
replaced, errors are reported, and the pool works from threads and inside daemonic processes."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest

from megatron_rl.reward.math.pool import WorkerPool


def _job(kind: str, value: int = 0):
    if kind == "ok":
        return value * 2
    if kind == "sleep":
        time.sleep(value)
        return "late"
    if kind == "spin":
        while True:  # pure-Python loop: only a signal from outside stops it
            pass
    if kind == "raise":
        raise ValueError("bad input")
    if kind == "exit":
        os._exit(3)
    if kind == "pid":
        return os.getpid()
    raise AssertionError(kind)


@pytest.fixture
def pool():
    p = WorkerPool(_job, max_workers=2)
    yield p
    p.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ok_and_reuse(pool):
    assert pool.call(("ok", 21), 5).value == 42
    pid = pool.call(("pid",), 5).value
    assert pool.call(("pid",), 5).value == pid and pid != os.getpid()


def test_descriptors_above_fd_setsize():
    """A long-lived process may hold > 1024 descriptors (select() refuses those): results and time
    limits still work."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        p = WorkerPool(_job, max_workers=1)
        try:
            assert p.call(("ok", 4), 5).value == 8
            assert p.call(("spin",), 0.3).status == "timeout"
            assert p.call(("ok", 5), 5).value == 10
        finally:
            p.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_timeout_kills_and_replaces_the_worker(pool):
    pid = pool.call(("pid",), 5).value
    res = pool.call(("spin",), 0.5)
    assert res.status == "timeout" and res.value is None
    assert not _alive(pid)  # killed and reaped (no zombie left)
    assert pool.n_killed == 1
    new_pid = pool.call(("pid",), 5).value
    assert new_pid != pid
    assert pool.call(("ok", 1), 5).value == 2


def test_error_and_crash_are_reported(pool):
    res = pool.call(("raise",), 5)
    assert res.status == "error" and "ValueError: bad input" in res.error
    res = pool.call(("exit",), 5)
    assert res.status == "crash"
    assert pool.call(("ok", 2), 5).value == 4


def test_threads_share_the_pool(pool):
    results = []

    def work(i):
        results.append(pool.call(("ok", i), 10).value)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [2 * i for i in range(6)]


def _in_daemon(q):
    p = WorkerPool(_job, max_workers=1)
    q.put((p.call(("ok", 5), 5).value, p.call(("spin",), 0.3).status, p.call(("ok", 6), 5).value))
    p.close()


def test_works_inside_a_daemonic_multiprocessing_worker():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_in_daemon, args=(q,), daemon=True)
    proc.start()
    assert q.get(timeout=30) == (10, "timeout", 12)
    proc.join(10)
    assert proc.exitcode == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        WorkerPool(_job, max_workers=0)
    p = WorkerPool(_job, max_workers=1)
    with pytest.raises(ValueError):
        p.call(("ok", 1), 0)
    p.close()


def _unpicklable_result(_):
    return threading.Lock()


def test_a_result_that_cannot_be_pickled_is_reported_as_an_error():
    p = WorkerPool(_unpicklable_result, max_workers=1)
    try:
        res = p.call((0,), 5)
        assert res.status == "error" and "pickle" in res.error, res
        assert p.call((1,), 5).status == "error"  # the same worker answers again: the pipe stayed in step
        assert p.n_killed == 0
    finally:
        p.close()
