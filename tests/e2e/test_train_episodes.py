"""`megatron-rl train` with multi-turn episodes (env.name: echo) under mpiexec: two real updates whose
batches hold environment tokens, where the trainer's loss counts exactly the batch's model-sampled
tokens, the metrics line reports the episodes and episodes waiting on a slow tool let more start
(env.extra_in_flight); and episodes in flight through a kill -9 and a
SIGTERM, each continued by `--resume` from its last turn boundary, every group trained once."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml

from megatron_rl.control.metrics import METRICS_FILE, read_jsonl
from megatron_rl.data.synthetic import addition_problems
from megatron_rl.train.checkpoint_manifest import CheckpointError
from support.runs import assert_every_prompt_accounted_once, controller_state, launch_train, train_to_the_end

pytestmark = pytest.mark.timeout(900)
PLUGINS = Path(__file__).resolve().parents[1] / "support" / "reward_plugins.py"
# The tiny model's template ends each turn with its eos token, where the generator stops: the episode's
# observations can follow a turn as the template renders them.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def _chat_model(tmp_path: Path, tiny_llama_dir) -> Path:
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return model


def test_two_updates_of_echo_episodes(tmp_path, tiny_llama_dir, free_port):
    model = _chat_model(tmp_path, tiny_llama_dir)
    cfg = {
        "trainer": {"model": str(model), "precision": "fp32", "lr": 1e-4, "micro_batch_tokens": 2048},
        "rollout": {"group_size": 4, "n_async": 8, "n_batch": 8, "n_mini": 2, "max_new_tokens": 64},
        "generator": {"max_total_tokens": 4096, "port_base": 34000 + free_port % 2000},
        "reward": {"custom": f"{PLUGINS}:digit_share", "l_max": 64, "l_cache": 8,
                   "language_check": False, "verifier_workers": 1},
        # each step is a 0.5 s tool: while episodes wait on it, up to 8 more start (env.extra_in_flight)
        "env": {"name": "echo", "args": {"turns": 2, "delay_s": 0.5}, "max_turns": 3, "max_turn_tokens": 12,
                "extra_in_flight": 8},
        "data": {"source": "jsonl", "path": str(addition_problems(tmp_path / "problems.jsonl", 16)),
                 "system_prompt": "none"},
        "run": {"output_dir": str(tmp_path / "run"), "updates": 2, "checkpoint_every": 0},
    }
    rows = train_to_the_end(tmp_path, cfg)
    assert [r["update"] for r in rows] == [1, 2]
    # the generator reported its episodes in tools and the controller admitted groups beyond n_async = 8
    assert 8 < max(r["in_flight_peak"] for r in rows) <= 16
    for r in rows:
        # the loss counts the model's tokens of the batch, not its environment tokens
        assert r["train/loss_tokens"] == r["batch/loss_tokens"] < r["batch/tokens"]
    graded = [r for r in rows if r["rollouts"]]  # a line whose window graded nothing has no episode stats
    assert graded
    for r in graded:
        # echo ends an episode after 2 turns; one whose echo would overflow the 64-token cap ends after 1
        assert 1 < r["episode/turns"] <= 2 and r["episode/env_failed"] == 0
        assert r["episode/stop/done"] + r.get("episode/stop/max_tokens", 0) == pytest.approx(1.0)
        assert 0 < r["episode/env_token_frac"] < 1
        assert r["episode/cached_prefix_frac"] > 0  # the second turn reuses the first's prefix


def _until(proc, what: str, ready, timeout_s: float = 600):
    deadline = time.time() + timeout_s
    while not (got := ready()):
        assert proc.poll() is None, proc.stdout.read()[-5000:]
        assert time.time() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.3)
    return got


def _checkpoint_holding_episodes(run_dir: Path, after: int) -> dict | None:
    """The controller state of a checkpoint later than update `after` with episodes in flight at a boundary."""
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    if not tracker.is_file() or int(tracker.read_text()) <= after:
        return None
    try:
        state = controller_state(run_dir)
    except (OSError, ValueError, KeyError, CheckpointError):  # being written
        return None
    return state if state["episodes"] else None


@pytest.mark.long
def test_episodes_in_flight_continue_after_a_kill_9_and_a_sigterm_and_each_group_trains_once(
        tmp_path, tiny_llama_dir, free_port):
    """Slow 4-turn episodes (0.3 s a step) so checkpoints catch many between turns. kill -9 of the
    controller once a checkpoint holds such episodes, `--resume`, SIGTERM past the next update (its
    checkpoint holds those in flight then), `--resume` to the end: the episodes continue from their
    boundaries (turns taken from the checkpoint, none replayed differently), every drawn prompt ends in
    exactly one group or is pending, and every update is logged once."""
    problems = addition_problems(tmp_path / "problems.jsonl", 64)
    updates = 8
    cfg = {
        "trainer": {"model": str(_chat_model(tmp_path, tiny_llama_dir)), "precision": "fp32", "lr": 1e-4,
                    "micro_batch_tokens": 2048},
        # twice a batch in flight: episodes run on while the trainer updates, so checkpoints catch them
        "rollout": {"group_size": 4, "n_async": 16, "n_batch": 8, "n_mini": 1, "max_new_tokens": 96,
                    "max_staleness": 1000},
        "generator": {"max_total_tokens": 4096, "port_base": 36000 + free_port % 2000},
        "reward": {"custom": f"{PLUGINS}:digit_share", "l_max": 96, "l_cache": 8, "language_check": False,
                   "verifier_workers": 1},
        "env": {"name": "echo", "args": {"turns": 4, "delay_s": 0.3}, "max_turns": 4, "max_turn_tokens": 8},
        "data": {"source": "jsonl", "path": str(problems), "system_prompt": "none"},
        "run": {"output_dir": str(tmp_path / "run"), "updates": updates, "checkpoint_every": 1},
    }
    config, run_dir = tmp_path / "run.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(cfg))

    proc = launch_train(config)
    killed = _until(proc, "checkpoint with episodes in flight", lambda: _checkpoint_holding_episodes(run_dir, 0))
    controller = next(p for p in (run_dir / "ranks").glob("*.pid") if p.read_text().split()[1] == "controller")
    os.kill(int(controller.read_text().split()[0]), signal.SIGKILL)
    proc.communicate(timeout=180)
    assert proc.returncode != 0
    saved = killed["updates_done"]

    resumed_at = time.time()  # the killed run's rows past its checkpoint are still there until the resume cuts them
    proc = launch_train(config, "--resume")
    _until(proc, "update after the resume", lambda: any(r["time"] > resumed_at for r in read_jsonl(run_dir / METRICS_FILE)))
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-5000:]
    stopped = controller_state(run_dir)
    assert stopped["updates_done"] < updates and stopped["episodes"], "the SIGTERM's checkpoint holds no episode"

    out, _ = launch_train(config, "--resume").communicate(timeout=600)
    rows = read_jsonl(run_dir / METRICS_FILE)
    assert [r["update"] for r in rows] == list(range(1, updates + 1)), out[-5000:]
    after = [r for r in rows if r["update"] > saved and r["rollouts"]]
    assert sum(r["episode/resumed_turns"] for r in after) > 0  # continued, not started over
    assert all(r["episode/replay_diverged"] == 0 and r["episode/env_failed"] == 0 for r in after)
    assert all(r["train/loss_tokens"] == r["batch/loss_tokens"] for r in rows)
    assert_every_prompt_accounted_once(run_dir, problems)
