"""Real processes the end-to-end tests start: an SGLang generator on the tiny model, and
`megatron-rl train` as a user would run it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from megatron_rl.config import GeneratorConfig, RolloutConfig
from megatron_rl.rollout.generator import Generator
from megatron_rl.rollout.server import ServerSpec, SGLangServer
from support.net import free_port


@contextmanager
def running_generator(model_dir: Path, log_dir: Path, group_size: int = 2, max_total_tokens: int = 8192,
                      concurrency: int = 8, **spec) -> Iterator[Generator]:
    """A started Generator (its own SGLang server, prefix cache never reused across versions, up to
    `concurrency` samples running); closed, with its server gone, on exit."""
    server = ServerSpec(str(model_dir), free_port(), max_total_tokens=max_total_tokens,
                        log_path=str(log_dir / "server.log"), **spec)
    gen = Generator(SGLangServer(server), RolloutConfig(group_size=group_size, n_async=8, n_batch=group_size,
                                                        n_mini=1),
                    GeneratorConfig(prefix_cache_max_staleness=0), max_concurrency=concurrency)
    gen.start()
    try:
        yield gen
    finally:
        gen.close()
    assert not gen.server.alive()


class RecordedClient:
    """A server's real client, keeping every /generate body and answer (`calls`) and when each request
    ran (`spans`: start, end)."""

    def __init__(self, client):
        self.client, self.calls, self.spans = client, [], []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def generate(self, body, on_tokens=None):
        t = time.perf_counter()
        try:
            out = self.client.generate(body, on_tokens)
        finally:
            self.spans.append((t, time.perf_counter()))
        self.calls.append((body, out))
        return out


def launch_train(config: Path, *extra: str) -> subprocess.Popen:
    """`megatron-rl train CONFIG ...` in its own session (a test can kill the whole job), one thread
    per rank, output captured as text."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train", str(config), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def train_to_the_end(run_dir: Path, cfg: dict, timeout_s: float = 800) -> list[dict]:
    """Write `cfg` as `run_dir`/run.yaml, run `megatron-rl train` on it to its end (exit status 0, else
    the output's tail in the failure) and return the metrics lines of `run.output_dir`."""
    import yaml

    from megatron_rl.control.metrics import METRICS_FILE, read_jsonl

    config = Path(run_dir) / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = launch_train(config)
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-6000:]
    return read_jsonl(Path(cfg["run"]["output_dir"]) / METRICS_FILE)


def controller_state(run_dir: Path) -> dict:
    """The controller's state in the run's latest checkpoint."""
    from megatron_rl.train.checkpoint import read_common

    return read_common(Path(run_dir) / "checkpoints")["extra"]["user"]["controller"]


def assert_every_prompt_accounted_once(run_dir: Path, problems: Path, seed: int = 0) -> None:
    """Prompts drawn = completed groups + groups pending in the last checkpoint, each exactly once."""
    from megatron_rl.control.metrics import EVENTS_FILE, read_jsonl
    from megatron_rl.control.problems import ProblemQueue
    from megatron_rl.data import read_jsonl as read_problems

    state = controller_state(run_dir)
    events = read_jsonl(Path(run_dir) / EVENTS_FILE)
    group_ids = [e["group_id"] for e in events]
    assert len(group_ids) == len(set(group_ids)), "a group completed twice"
    queue = ProblemQueue(read_problems(problems), seed=seed)
    drawn = [queue.next().problem_id for _ in range(state["queue"]["issued"])]
    pending = [g["problem"]["problem_id"] for g in state["budget"]["groups"]]
    assert not state["queue"]["requeued"]
    assert sorted([e["problem_id"] for e in events] + pending) == sorted(drawn)
