"""`plan.step_memory.measure` on 2 gloo ranks (torchrun): the CP=2 step reports both ranks and its
loss equals the single-process CP=1 step's (the step's metrics are summed over the CP ranks), so the
multi-rank path measures the same training step (benchmarks/context_parallel.py relies on it)."""
import random
import subprocess
import threading
import time

import psutil
import pytest

from megatron_rl.plan.step_memory import measure

pytestmark = pytest.mark.long  # minutes of multi-process runs: the long tier (README "Tests")

MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)


def _spec(cp: int) -> dict:
    return {"model": MODEL, "nproc": cp, "repeats": 0, "seq_lengths": [40, 24],
            "trainer": {"precision": "fp32", "micro_batch_tokens": 64, "context_parallel": cp}}


def test_two_rank_measure_reports_each_rank_of_the_same_step():
    one, two = measure(_spec(1)), measure(_spec(2))
    assert "ranks" not in one and one["rank"] == 0
    assert [r["rank"] for r in two["ranks"]] == [0, 1]
    assert two["growth_bytes"] == max(r["growth_bytes"] for r in two["ranks"])
    assert two["tokens_per_s"] == min(r["tokens_per_s"] for r in two["ranks"])
    assert two["tokens"] == one["tokens"] == 64 and two["n_micro_batches"] == one["n_micro_batches"] == 1
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)


def _processes_with(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def test_timeout_kills_the_rank_processes_too():
    seed = random.randrange(10**11, 10**12)  # in every rank's command line: finds them
    spec = {**_spec(2), "repeats": 10**9, "seed": seed}
    outcome, seen = [], 0
    worker = threading.Thread(target=lambda: outcome.append(_timed_out(spec)))
    worker.start()
    while worker.is_alive():
        seen = max(seen, len(_processes_with(f'"seed": {seed}')))
        time.sleep(0.2)
    assert outcome == [True]
    if seen < 3:  # torchrun + 2 ranks
        pytest.skip(f"the ranks had not started within the timeout ({seen} processes seen)")
    deadline = time.time() + 10
    while _processes_with(f'"seed": {seed}') and time.time() < deadline:
        time.sleep(0.2)
    assert _processes_with(f'"seed": {seed}') == []


def _timed_out(spec: dict) -> bool:
    try:
        measure(spec, timeout=30)
    except subprocess.TimeoutExpired:
        return True
    return False
