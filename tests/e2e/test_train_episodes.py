"""`megatron-rl train` with multi-turn episodes (env.name: echo) under mpiexec: two real updates whose
batches hold environment tokens, where the trainer's loss counts exactly the batch's model-sampled
tokens, and the metrics line reports the episodes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_rl.data.synthetic import addition_problems
from support.runs import train_to_the_end

pytestmark = pytest.mark.timeout(900)
PLUGINS = Path(__file__).resolve().parents[1] / "support" / "reward_plugins.py"
# The tiny model's template ends each turn with its eos token, where the generator stops: the episode's
# observations can follow a turn as the template renders them.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def test_two_updates_of_echo_episodes(tmp_path, tiny_llama_dir, free_port):
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = {
        "trainer": {"model": str(model), "precision": "fp32", "lr": 1e-4, "micro_batch_tokens": 2048},
        "rollout": {"group_size": 4, "n_async": 8, "n_batch": 8, "n_mini": 2, "max_new_tokens": 64},
        "generator": {"max_total_tokens": 4096, "port_base": 34000 + free_port % 2000},
        "reward": {"custom": f"{PLUGINS}:digit_share", "l_max": 64, "l_cache": 8,
                   "language_check": False, "verifier_workers": 1},
        "env": {"name": "echo", "args": {"turns": 2}, "max_turns": 3, "max_turn_tokens": 12},
        "data": {"source": "jsonl", "path": str(addition_problems(tmp_path / "problems.jsonl", 16)),
                 "system_prompt": "none"},
        "run": {"output_dir": str(tmp_path / "run"), "updates": 2, "checkpoint_every": 0},
    }
    rows = train_to_the_end(tmp_path, cfg)
    assert [r["update"] for r in rows] == [1, 2]
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
