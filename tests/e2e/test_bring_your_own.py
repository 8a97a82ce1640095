"""docs/your_model_and_data.md as a test: a hub id from a local HF cache (HF_HOME in tmp), a parquet
set with chat-message prompts and nested answers, a system prompt file, and a reward plug-in file;
`megatron-rl train` runs updates graded by the plug-in (the built-in reward would give the tiny
random model's untagged samples nothing)."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support.hf_cache import cache_model
from support.runs import train_to_the_end

pytestmark = [pytest.mark.long, pytest.mark.timeout(900)]
PLUGINS = Path(__file__).resolve().parents[1] / "support" / "reward_plugins.py"


def test_hub_model_parquet_chat_data_and_reward_plugin(tmp_path, tiny_llama_dir, free_port, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    cache_model(tmp_path / "hf", "tiny-org/tiny-llama", tiny_llama_dir)
    rng = random.Random(0)
    pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(32)]
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}],
             "reward_model": {"ground_truth": str(a + b)}, "level": i % 3} for i, (a, b) in enumerate(pairs)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "system.txt").write_text("Answer with the number only.")
    cfg = {
        "trainer": {"model": "tiny-org/tiny-llama", "precision": "fp32", "lr": 1e-4, "micro_batch_tokens": 1024},
        "rollout": {"group_size": 4, "n_async": 8, "n_batch": 8, "n_mini": 1, "max_new_tokens": 12},
        "generator": {"max_total_tokens": 4096, "port_base": 34000 + free_port % 2000},
        "reward": {"custom": f"{PLUGINS}:digit_share", "l_max": 12, "l_cache": 4, "language_check": False,
                   "verifier_workers": 1},
        "data": {"source": "parquet", "path": str(tmp_path / "train.parquet"), "prompt_key": "messages",
                 "answer_key": "reward_model.ground_truth", "system_prompt_file": str(tmp_path / "system.txt")},
        "run": {"output_dir": str(tmp_path / "run"), "updates": 2, "checkpoint_every": 0},
    }
    metrics = train_to_the_end(tmp_path, cfg)
    assert [r["update"] for r in metrics] == [1, 2]
    groups = [json.loads(line) for line in (tmp_path / "run" / "groups.jsonl").read_text().splitlines()]
    kept = [g for g in groups if g["fate"] == "kept"]
    assert len(kept) >= 2 * 8 // 4  # two batches of 8 samples, 4 per group
    rewards = [r for g in groups for r in g["rewards"]]
    # the plug-in's values: a tenth of a digit share, or 1 for the answer; never the built-in's 0-only
    assert all(0.0 <= r <= 0.1 or r == 1.0 for r in rewards) and any(r > 0 for r in rewards)
    assert os.environ["HF_HOME"] == str(tmp_path / "hf")
