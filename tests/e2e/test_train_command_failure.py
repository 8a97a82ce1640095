"""`megatron-rl train` on a run that fails on a worker rank with bad input: a resume from a checkpoint
root in the old layout (step_NNNNNNNN/ + latest), refused by the trainer when the controller asks it
to load. The job's last line names the trainer rank and the error in one line, with no traceback and
no advice to start it again (the next start would meet the same error); tests/unit/
test_train_failure_message.py covers the other causes."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from megatron_rl.data.synthetic import addition_problems
from support.runs import launch_train

pytestmark = [pytest.mark.long, pytest.mark.timeout(900)]


def _finished(proc: subprocess.Popen, timeout_s: float = 780) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # `megatron-rl train` passes it on: the controller stops every rank
        out, _ = proc.communicate(timeout=90)
        pytest.fail(f"the job did not end in {timeout_s:.0f} s:\n{out[-6000:]}")
    return out


def test_an_old_layout_checkpoint_ends_the_job_with_one_line_naming_the_trainer_rank(tmp_path, tiny_llama_dir,
                                                                                     free_port):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000012").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000012\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"model": str(tiny_llama_dir), "precision": "fp32", "micro_batch_tokens": 512},
        "rollout": {"group_size": 2, "n_async": 2, "n_batch": 2, "n_mini": 1, "max_new_tokens": 8},
        "generator": {"max_total_tokens": 2048, "port_base": 30000 + free_port % 5000},
        "reward": {"verifier_workers": 1, "language_check": False},
        "data": {"source": "jsonl", "path": str(addition_problems(tmp_path / "problems.jsonl", 8))},
        "run": {"output_dir": str(run_dir), "updates": 1, "checkpoint_every": 0}}))
    proc = launch_train(config, "--resume")
    out = _finished(proc)
    assert proc.returncode == 1, out[-6000:]
    last = out.strip().splitlines()[-1]
    assert last.endswith(f"megatron-rl train: the job ended with status 1: trainer rank 1 failed: {run_dir}/"
                         f"checkpoints holds checkpoints in the old layout (step_NNNNNNNN/ + latest): rename "
                         f"each directory to Megatron-LM's (e.g. mv step_00000012 iter_0000012) and replace "
                         f"`latest` by latest_checkpointed_iteration.txt holding the step number (e.g. echo 12 "
                         f"> latest_checkpointed_iteration.txt), or pass one step directory itself"), last
    assert "Traceback" not in out and "CheckpointError" not in out, out[-6000:]
    assert json.loads((run_dir / "failure.json").read_text())["cause"] == "input"
    assert not (run_dir / "failure_traceback.txt").exists()
