"""A real SGLang server with tensor parallelism 2 on CPU (two TP ranks, each bound to its own cores):
greedy output equals HF transformers' before and after a weight push over a group of 1 sender + 2
server ranks, as the controller sizes it from generator.tp_size."""
from __future__ import annotations

import pytest

from megatron_rl.sync.sender import WeightSender
from megatron_rl.sync.update import push_in_process, target_of

from support.runs import running_generator
from test_generator import assert_matches_hf, hf_model, named, perturbed

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gen_tp2(tiny_llama_dir, tmp_path_factory):
    with running_generator(tiny_llama_dir, tmp_path_factory.mktemp("sglang_tp2"), max_total_tokens=4096,
                           tp_size=2) as g:
        yield g


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
