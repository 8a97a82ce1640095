"""kill -9 of one rank of each role mid-run, then `--resume`, under mpiexec (MPICH).

MPICH's mpiexec ends every rank when one dies by a signal, so each kill ends the job: the test checks it
ends (no hang) with the launcher's message naming --resume, that no process of the job outlives it
(SGLang servers, grading processes), and that `--resume` finishes the run with every drawn prompt and
every sample accounted for exactly once, reading only the run's own records: groups.jsonl (one event
per finished group with each sample's fate), metrics.jsonl (one row per update, cut back to the
checkpoint on resume) and the controller state in the final checkpoint (budget counters, pending
groups, the problem cursor). The layout is the smallest e2e loop: controller, 1 trainer, 1 generator,
1 verifier rank, the tiny Llama after a short SFT (tests/support/warm_start.py) so groups are diverse.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from megatron_rl.control.metrics import EVENTS_FILE, METRICS_FILE, read_jsonl
from megatron_rl.control.problems import ProblemQueue
from megatron_rl.data import read_jsonl as read_problems
from support.runs import controller_state, launch_train

pytestmark = [pytest.mark.long, pytest.mark.e2e, pytest.mark.timeout(900)]

G, N_BATCH, UPDATES, CHECKPOINT_EVERY = 4, 16, 10, 2  # four kills, each past a later checkpoint: 2, 4, 6, 8


@pytest.fixture(scope="module")
def policy(tiny_llama_dir, tmp_path_factory):
    from support.warm_start import addition_problems, sft_tiny_policy

    root = tmp_path_factory.mktemp("policy")
    problems = addition_problems(root / "problems.jsonl", 600)
    return sft_tiny_policy(tiny_llama_dir, root / "warm", problems, steps=40), problems


def _config(tmp_path: Path, policy, port_base: int) -> Path:
    model, problems = policy
    cfg = {
        "trainer": {"model": str(model), "precision": "fp32", "lr": 5e-4, "micro_batch_tokens": 1024},
        "rollout": {"group_size": G, "n_async": N_BATCH, "n_batch": N_BATCH, "n_mini": 1, "max_new_tokens": 24,
                    "max_staleness": 1000},
        "generator": {"max_total_tokens": 4096, "port_base": port_base},
        "reward": {"l_max": 64, "l_cache": 16, "language_check": False, "format_reward": 1.0,
                   "correct_reward": 0.0, "verifier_workers": 1, "verifier_ranks": 1},
        "data": {"source": "jsonl", "path": str(problems), "system_prompt": "short"},
        "run": {"output_dir": str(tmp_path / "run"), "updates": UPDATES, "checkpoint_every": CHECKPOINT_EVERY},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _checkpointed_update(run_dir: Path) -> int:
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text()) if tracker.is_file() else 0


def _wait_past_a_checkpoint(proc: subprocess.Popen, run_dir: Path, after: int, timeout_s: float = 600) -> None:
    """Until a checkpoint later than update `after` exists and a metrics row of a still later update was
    written (something to cut back)."""
    deadline = time.time() + timeout_s
    while True:
        saved = _checkpointed_update(run_dir)
        rows = read_jsonl(run_dir / METRICS_FILE)
        if saved > after and rows and rows[-1]["update"] > saved:
            return
        assert proc.poll() is None, proc.stdout.read()[-5000:]
        assert time.time() < deadline, "no update after a checkpoint in time"
        time.sleep(0.2)


def _rank_pids(run_dir: Path) -> dict[str, list[int]]:
    """role -> pids of its ranks, from RUN_DIR/ranks/<rank>.pid ("PID ROLE HOST")."""
    out: dict[str, list[int]] = {}
    for path in sorted((run_dir / "ranks").glob("*.pid"), key=lambda p: int(p.stem)):
        pid, role, _host = path.read_text().split()
        out.setdefault(role, []).append(int(pid))
    return out


def _job_processes(pids: list[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        p = psutil.Process(pid)
        procs += [p, *p.children(recursive=True)]
    return procs


def _survivors(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those still running after `timeout_s` (a zombie nobody reaped yet has ended)."""
    deadline = time.time() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


def _assert_accounted_once(run_dir: Path, problems: Path) -> None:
    """Every drawn prompt and every sample exactly once, every update once, from the run's own records."""
    state = controller_state(run_dir)
    budget, counters = state["budget"], state["budget"]["counters"]
    rows = read_jsonl(run_dir / METRICS_FILE)
    assert [r["update"] for r in rows] == list(range(1, UPDATES + 1)), "an update logged twice or not at all"
    assert state["updates_done"] == counters["batches"] == UPDATES
    assert counters["sequences_trained"] == UPDATES * N_BATCH

    events = read_jsonl(run_dir / EVENTS_FILE)
    assert len(events) == len((run_dir / EVENTS_FILE).read_text().splitlines()), "a cut line in groups.jsonl"
    ids = [e["group_id"] for e in events]
    assert len(ids) == len(set(ids)), "a group finished twice"
    pending = budget["groups"]
    assert not {g["group_id"] for g in pending} & set(ids), "a group both finished and pending"
    # prompts: drawn from the problem stream = finished groups + groups pending in the checkpoint
    queue = ProblemQueue(read_problems(problems), seed=0)
    drawn = [queue.next().problem_id for _ in range(state["queue"]["issued"])]
    assert not state["queue"]["requeued"] and not budget["requeue"]
    assert sorted([e["problem_id"] for e in events] + [g["problem"]["problem_id"] for g in pending]) == sorted(drawn)
    assert counters["groups_started"] == len(drawn) == len(events) + len(pending)
    # samples: each of a finished group's G has one fate; a pending group's are graded, failed or re-issued
    for e in events:
        assert sorted(e["graded"] + e["failed"]) == list(range(G)), e
        assert (e["fate"] == "grading_failed") == bool(e["failed"]), e
    for g in pending:
        back = [int(i) for i in g["rollouts"]] + g["failed"]
        assert len(back) == len(set(back)) and set(back) <= set(range(G)), g
    # the budget's counters agree with the events; every sample of a kept group trained once or ready
    fates = [e["fate"] for e in events]
    assert counters["groups_completed"] == len(events)
    assert counters["groups_dropped_non_diverse"] == fates.count("non_diverse")
    assert counters["groups_dropped_grading"] == fates.count("grading_failed")
    assert counters["groups_dropped_stale"] == 0
    assert G * fates.count("kept") == counters["sequences_trained"] + len(budget["ready"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates"] == UPDATES and not summary["stopped_early"]


def _kill_and_check_the_end(proc: subprocess.Popen, run_dir: Path, role: str, after: int) -> int:
    """kill -9 the first rank of `role` past a checkpoint later than `after`; the job must end, with the
    launcher's message, leaving no process behind. Returns the checkpointed update."""
    _wait_past_a_checkpoint(proc, run_dir, after)
    ranks = _rank_pids(run_dir)
    job = _job_processes([pid for pids in ranks.values() for pid in pids])
    os.kill(ranks[role][0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)  # ends, does not hang
    assert proc.returncode != 0, out[-3000:]
    assert "megatron-rl train: the job ended with status" in out and "--resume" in out, out[-3000:]
    alive = _survivors(job, timeout_s=60)
    assert not alive, f"outlived the job after kill -9 of the {role}: {[(p.pid, p.name()) for p in alive]}"
    saved = _checkpointed_update(run_dir)
    assert read_jsonl(run_dir / METRICS_FILE)[-1]["update"] > saved  # rows for the resume to cut back
    return saved


# One run, four kills (each launch costs a server and trainer start-up: ~1 min per kill on 2 cores).
def test_kill_9_of_a_rank_of_each_role_ends_the_job_and_resume_finishes_it_accounting_everything_once(
        tmp_path, policy, free_port):
    config = _config(tmp_path, policy, 35000 + free_port % 2000)
    run_dir = tmp_path / "run"
    saved = 0
    for i, role in enumerate(("controller", "trainer", "generator", "verifier")):
        launched = launch_train(config, "--resume") if i else launch_train(config)
        saved = _kill_and_check_the_end(launched, run_dir, role, after=saved)
    resumed = launch_train(config, "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-6000:]
    _assert_accounted_once(run_dir, policy[1])
