"""Verifier pool: parallel grading, per-item timeouts, worker crashes, timings."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from megatron_rl.config import RewardConfig
from megatron_rl.reward import TaskError, VerifierPool, score, score_batch

os.environ.setdefault("OMP_NUM_THREADS", "1")

PROBLEM = "What is the sum of the first ten positive integers?"
THOUGHTS = "Pairing the first and last terms gives five pairs of eleven, so the sum is $5 \\cdot 11 = 55$."
TASK = {"kind": "math", "answer": "55", "problem": PROBLEM}


def resp(box: str) -> str:
    return f"<think>{THOUGHTS}</think>\nThe answer is $\\boxed{{{box}}}$."


def scripted(task, response, config, num_tokens):
    """Grading function with injected faults, keyed by the response text (module level: picklable)."""
    if response.startswith("HANG"):
        _, marker = response.split(":", 1)
        child = subprocess.Popen(["sleep", "300"])  # something the worker started, must die with it
        with open(marker, "w") as f:
            f.write(str(child.pid))
        time.sleep(300)
    if response.startswith("SLOW"):
        _, marker, seconds = response.split(":")
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(float(seconds))
        response = resp("55")
    if response == "CRASH":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "RAISE":
        raise RuntimeError("verifier bug")
    return score(task, response, config, num_tokens)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(RewardConfig(), workers=2, item_timeout_s=3.0, fn=scripted) as p:
        p.wait_ready()
        yield p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_results_match_sequential_scoring_in_input_order():
    items = [(TASK, resp(b), 100) for b in ("55", "56", "\\frac{110}{2}", "x")]
    items += [{"task": TASK, "response": "no tags", "num_tokens": 3}, (TASK, resp("55"))]
    got = score_batch(items, RewardConfig(), workers=2)
    for item, r in zip(items, got):
        task, response, n = (item["task"], item["response"], item["num_tokens"]) if isinstance(item, dict) \
            else (item[0], item[1], item[2] if len(item) == 3 else None)
        want = score(task, response, num_tokens=n)
        assert (r.status, r.format_ok, r.correct, r.language_ok, r.total, r.num_tokens) == \
               ("ok", want.format_ok, want.correct, want.language_ok, want.total, want.num_tokens)
    assert [r.correct for r in got] == [True, False, True, False, False, True]


def test_hung_item_times_out_kills_its_children_and_does_not_block_others(pool, tmp_path):
    marker = tmp_path / "hang.pid"
    items = [(TASK, f"HANG:{marker}")] + [(TASK, resp("55"), 10)] * 6
    got = pool.map(items)
    assert got[0].status == "timeout" and got[0].total == 0.0 and "3 s" in got[0].error
    assert all(r.status == "ok" and r.correct for r in got[1:])
    assert pool.last_stats.n_timeout == 1 and pool.last_stats.worker_restarts == 1
    child = int(marker.read_text())
    deadline = time.time() + 5
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the hung worker's child process survived the timeout"
    assert [r.correct for r in pool.map([(TASK, resp("55"), 10)])] == [True]  # pool still serves


def test_killed_worker_item_is_reissued(pool, tmp_path):
    marker = tmp_path / "slow.pids"
    items = [(TASK, f"SLOW:{marker}:1.5")] + [(TASK, resp("55"), 10)] * 3
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=pool.map(items)))
    thread.start()
    deadline = time.time() + 30
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.02)
    victim = int(marker.read_text().split()[0])
    assert victim in pool.worker_pids()
    os.kill(victim, signal.SIGKILL)  # kill -9 the worker grading the slow item
    thread.join(60)
    got = out["r"]
    assert [r.status for r in got] == ["ok"] * 4 and all(r.correct for r in got)
    assert len(marker.read_text().split()) == 2  # graded a second time, by another worker
    assert victim not in pool.worker_pids() and len(pool.worker_pids()) == 2
    assert pool.last_stats.worker_restarts >= 1


def test_item_that_always_crashes_and_grader_errors(pool):
    got = pool.map([(TASK, "CRASH"), (TASK, "RAISE"), (TASK, resp("55"), 10)])
    assert got[0].status == "crash" and got[0].total == 0.0 and "2 attempts" in got[0].error
    assert got[1].status == "error" and "verifier bug" in got[1].error
    assert got[2].status == "ok" and got[2].correct
    stats = pool.last_stats
    assert (stats.n_crash, stats.n_error, stats.n_items) == (1, 1, 3)
    assert stats.wall_s > 0 and stats.grade_s_total >= stats.grade_s_max > 0


def test_invalid_items_are_rejected_before_grading(pool):
    with pytest.raises(TaskError, match="item 1"):
        pool.map([(TASK, resp("1")), ({"kind": "math"}, resp("1"))])
    with pytest.raises(TaskError, match="item 0"):
        pool.map([(TASK,)])
