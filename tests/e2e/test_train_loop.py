"""The whole asynchronous loop under mpiexec: SGLang generator, Megatron trainer, verifier pool, MPI.

The policy is the tiny Llama after a brief SFT cold start (tests/support/warm_start.py), so it emits
the `<think>...</think> \\boxed{}` format about half of the time; the reward is the format reward only,
which a 2-layer model can learn in a few dozen updates. The runs also check the bookkeeping: every
prompt drawn from the problem stream is either in a completed group or pending in the checkpoint,
exactly once, through faults (kill -9 of the SGLang server and of a grading process) and through a
SIGTERM + --resume, all in one run.
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

from megatron_rl.control.metrics import METRICS_FILE, read_jsonl
from support.metric_logs import assert_same, jsonl_numbers, tensorboard_scalars
from support.runs import assert_every_prompt_accounted_once, controller_state, launch_train

pytestmark = [pytest.mark.long, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def policy(tiny_llama_dir, tmp_path_factory):
    from support.warm_start import addition_problems, sft_tiny_policy

    root = tmp_path_factory.mktemp("policy")
    problems = addition_problems(root / "problems.jsonl", 600)
    return sft_tiny_policy(tiny_llama_dir, root / "warm", problems, steps=40), problems


def _config(tmp_path: Path, policy, port_base: int, **sections) -> Path:
    model, problems = policy
    cfg = {
        "trainer": {"model": str(model), "precision": "fp32", "lr": 5e-4, "micro_batch_tokens": 1024},
        "rollout": {"group_size": 8, "n_async": 32, "n_batch": 32, "n_mini": 1, "max_new_tokens": 24,
                    "max_staleness": 1000},
        "generator": {"max_total_tokens": 4096, "port_base": port_base},
        "reward": {"l_max": 64, "l_cache": 16, "language_check": False, "format_reward": 1.0,
                   "correct_reward": 0.0, "verifier_workers": 1},
        "data": {"source": "jsonl", "path": str(problems), "system_prompt": "short"},
        "run": {"output_dir": str(tmp_path / "run"), "updates": 12, "checkpoint_every": 0},
    }
    for section, values in sections.items():
        cfg[section].update(values)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _wait_for_updates(proc: subprocess.Popen, run_dir: Path, n: int, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while len(read_jsonl(run_dir / METRICS_FILE)) < n:
        assert proc.poll() is None, proc.stdout.read()[-5000:]
        assert time.time() < deadline, f"fewer than {n} updates in {timeout_s} s"
        time.sleep(0.5)


def _finish(proc: subprocess.Popen, timeout_s: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-6000:]
    return out


def _rewards(run_dir: Path) -> list[tuple[float, float]]:
    # (mean reward, rollouts graded) per update; a window that graded nothing has no reward/mean
    return [(r.get("reward/mean", 0.0), r["rollouts"]) for r in read_jsonl(run_dir / METRICS_FILE)]


def _weighted_mean(rows) -> float:
    return sum(r * n for r, n in rows) / sum(n for _, n in rows)


def _pids(match) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "ppid"]):
        try:
            if match(p):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _placement(run_dir: Path, port: int) -> tuple[set[int], set[int], str]:
    """The cores of the trainer rank and of the SGLang server's scheduler (every thread of it), and the
    server's OMP_NUM_THREADS; its HTTP front end stays on every core (ServerSpec.shared_cores)."""
    trainer = [int(f.read_text().split()[0]) for f in (run_dir / "ranks").glob("*.pid")
               if f.read_text().split()[1] == "trainer"]
    server = _pids(lambda p: "sglang.launch_server" in " ".join(p.info["cmdline"] or []) and
                   f"--port {port}" in " ".join(p.info["cmdline"] or []))
    assert len(trainer) == 1 and server, (trainer, server)
    scheduler = [c for c in server[0].children() if "scheduler" in c.name() or "scheduler" in " ".join(c.cmdline())]
    assert scheduler and set(server[0].cpu_affinity()) == os.sched_getaffinity(0)
    server_cores = {frozenset(os.sched_getaffinity(t.id)) for p in scheduler for t in p.threads()}
    assert len(server_cores) == 1, server_cores
    return (set(psutil.Process(trainer[0]).cpu_affinity()), set(next(iter(server_cores))),
            server[0].environ().get("OMP_NUM_THREADS"))


def _check_split(trainer: set[int], server: set[int], omp: str) -> None:
    """run.cpu_placement split (control/node.py assign_cpus): half of the cores each, disjoint when
    there are two or more; one OpenMP thread per core of the server's share."""
    cores = os.sched_getaffinity(0)
    assert trainer | server <= cores and len(trainer) == len(server) == max(1, len(cores) // 2)
    assert len(cores) < 2 or not trainer & server, (trainer, server)
    assert omp == str(len(server))


# One run for both fault paths (each launch costs a server and trainer start-up on 2 cores).
def test_reward_rises_through_crashes_and_a_sigterm_resume_loses_and_repeats_nothing(tmp_path, policy, free_port):
    """kill -9 of the SGLang server, then of a grading process; the run continues. Then SIGTERM (as a
    scheduler sends it): a checkpoint, a protected run directory, and `--resume` finishes the run with
    every update once. The trainer and the server compute on disjoint halves of the cores (run.cpu_placement
    split), and on all of them after the resume with run.cpu_placement=shared. With run.loggers tensorboard: its event files, read back, hold the numbers of
    metrics.jsonl under the same names and updates, across the resume."""
    port = 31000 + free_port % 2000
    updates = 24
    config = _config(tmp_path, policy, port, run={"output_dir": str(tmp_path / "run"), "updates": updates,
                                                  "loggers": ["jsonl", "tensorboard"]})
    run_dir = tmp_path / "run"
    proc = launch_train(config)
    _wait_for_updates(proc, run_dir, 4)
    _check_split(*_placement(run_dir, port))
    server = _pids(lambda p: "sglang.launch_server" in " ".join(p.info["cmdline"] or []) and
                   f"--port {port}" in " ".join(p.info["cmdline"] or []))
    assert server, "SGLang server process not found"
    os.kill(server[0].pid, signal.SIGKILL)
    _wait_for_updates(proc, run_dir, 7)
    controller = _pids(lambda p: "megatron_rl.cli.rank" in " ".join(p.info["cmdline"] or []) and
                       any("multiprocessing" in " ".join(c.cmdline()) for c in p.children()))
    assert controller, "controller rank with grading workers not found"
    grader = [c for c in controller[0].children() if "multiprocessing" in " ".join(c.cmdline())][0]
    os.kill(grader.pid, signal.SIGKILL)
    _wait_for_updates(proc, run_dir, 10)
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler would: every rank gets it
    out = _finish(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] and summary["updates"] < updates, out[-3000:]
    stopped_at = summary["updates"]
    assert_every_prompt_accounted_once(run_dir, policy[1])

    out = _finish_failing(launch_train(config))  # without --resume the run directory is protected
    assert "--resume" in out
    proc = launch_train(config, "--resume", "run.cpu_placement=shared")
    _wait_for_updates(proc, run_dir, stopped_at + 1)
    trainer, server, omp = _placement(run_dir, port)  # shared: every process on every core
    assert trainer == server == os.sched_getaffinity(0) and omp == "1", (trainer, server, omp)
    _finish(proc)

    rows = read_jsonl(run_dir / METRICS_FILE)
    assert [r["update"] for r in rows] == list(range(1, updates + 1))
    assert all(r["version"] == r["update"] for r in rows)
    rewards = _rewards(run_dir)
    first, last = _weighted_mean(rewards[:5]), _weighted_mean(rewards[-5:])
    assert last > first, f"mean reward did not rise: first updates {first:.3f}, last {last:.3f}"
    assert any(r.get("versions_per_sequence/mean", 1) > 1 for r in rows), "no sequence spanned an update"
    # trainer.share_prompts: a group's samples in one bin hold their prompt once (docs/train.md)
    assert all(0 < r["train/shared_prompt_fraction"] < 1 and 0 <= r["train/padding_fraction"] < 1 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates"] == updates and not summary["stopped_early"]
    assert controller_state(run_dir)["updates_done"] == updates > stopped_at
    assert_every_prompt_accounted_once(run_dir, policy[1])
    scalars = tensorboard_scalars(run_dir)
    assert sorted(scalars["train/loss"]) == list(range(1, updates + 1)) and "reward/mean" in scalars
    assert_same(scalars, jsonl_numbers(run_dir))


def _finish_failing(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    return out
