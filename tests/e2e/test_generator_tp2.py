"""A real SGLang server with tensor parallelism 2 on CPU (two TP ranks, each bound to its own cores):
greedy output equals HF transformers' before and after a weight push over a group of 1 sender + 2
server ranks, as the controller sizes it from generator.tp_size."""
from __future__ import annotations

import pytest

from megatron_rl.config import GeneratorConfig, RolloutConfig
from megatron_rl.rollout.generator import Generator
from megatron_rl.rollout.server import ServerSpec, SGLangServer
from megatron_rl.sync.sender import WeightSender
from megatron_rl.sync.update import push_in_process, target_of

from test_generator import assert_matches_hf, hf_model, named, perturbed

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gen_tp2(tiny_llama_dir, tmp_path_factory):
    from support.net import free_port

    spec = ServerSpec(str(tiny_llama_dir), free_port(), max_total_tokens=4096, tp_size=2,
                      log_path=str(tmp_path_factory.mktemp("sglang_tp2") / "server.log"))
    g = Generator(SGLangServer(spec), RolloutConfig(group_size=2, n_async=8, n_batch=2, n_mini=1),
                  GeneratorConfig(prefix_cache_max_staleness=0), max_concurrency=8)
    g.start()
    yield g
    g.close()
    assert not g.server.alive()


def test_tp2_server_matches_hf_before_and_after_a_push(gen_tp2, tiny_llama_dir):
    hf = hf_model(tiny_llama_dir)
    assert_matches_hf(gen_tp2, hf, 0)
    targets = [target_of(gen_tp2)]
    assert [t.tp_size for t in targets] == [2]  # the update group: 1 sender + the server's 2 ranks
    new = perturbed(hf, seed=3)
    tensors = named(new)
    sender = WeightSender(0, targets, bucket_mb=0.05)
    try:
        push_in_process([gen_tp2], [(sender, tensors)], 1, expected_names=[n for n, _ in tensors])
    finally:
        sender.close()
    assert_matches_hf(gen_tp2, new, 1)
