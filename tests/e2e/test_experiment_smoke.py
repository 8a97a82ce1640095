"""`megatron-rl experiment` end to end, as CI runs it: one arm of batch_vs_minibatch, one seed, two updates
of the real loop (mpiexec, SGLang generator, Megatron trainer, verifier pool) on the tiny warm-started
policy. A smoke test of the command, not of the science: the table and both figures are written, the
metrics are copied, and running the same command again skips the finished run without training."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.long, pytest.mark.e2e, pytest.mark.timeout(1200)]  # ~2 min on an idle machine

# the tiny model and a format-only reward (as tests/e2e/test_train_loop.py), smaller batches
TINY = ["trainer.lr=5e-4", "trainer.micro_batch_tokens=1024", "rollout.n_async=16", "rollout.n_batch=8",
        "rollout.max_new_tokens=24", "rollout.max_staleness=1000", "generator.max_total_tokens=4096",
        "reward.l_max=64", "reward.l_cache=16", "reward.language_check=false", "reward.format_reward=1.0",
        "reward.correct_reward=0.0", "run.checkpoint_every=1"]


def _experiment(tmp_path: Path, model: Path, data: Path, port: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "experiment", "batch_vs_minibatch", "--arms", "n_mini1",
           "--seeds", "1", "--updates", "2", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "results"),
           "--base-model", str(model), "--data", str(data), *TINY, f"generator.port_base={port}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def test_one_arm_two_updates_then_a_rerun_skips_it(tmp_path, tiny_llama_dir, free_port):
    from support.warm_start import addition_problems, sft_tiny_policy

    data = tmp_path / "data"
    data.mkdir()
    problems = addition_problems(data / "problems.jsonl", 200)
    model = sft_tiny_policy(tiny_llama_dir, tmp_path / "warm", problems, steps=40)
    port = 33000 + free_port % 2000

    first = _experiment(tmp_path, model, data, port)
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    assert "n_mini1-seed0: started" in first.stdout
    results = tmp_path / "results"
    rows = [json.loads(line) for line in (results / "n_mini1-seed0.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2]
    table = (results / "table.md").read_text()
    assert "## reward/mean" in table and "| n_mini1 | 1 |" in table
    assert (results / "figure.png").stat().st_size > 0 and (results / "runs.png").stat().st_size > 0
    run_dir = tmp_path / "out" / "n_mini1" / "seed0"
    assert (run_dir / "experiment_done.json").is_file() and not (run_dir / "checkpoints").exists()

    again = _experiment(tmp_path, model, data, port)
    assert again.returncode == 0, (again.stdout + again.stderr)[-6000:]
    assert "n_mini1-seed0: skipped" in again.stdout and "(start)" not in again.stdout
    assert (results / "table.md").read_text() == table
