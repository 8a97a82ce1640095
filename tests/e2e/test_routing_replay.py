"""Routing replay end to end: a real SGLang server (CPU, bf16) samples a tiny Qwen3-MoE and returns the
experts it routed every position to; the Megatron trainer (bf16) scores the same tokens through its
update path (`Trainer.evaluate`) with those routes replayed, and without.

The model has many small experts (32, top-4: the gaps between the 4th and 5th router logits are
small), so that bf16 rounding on either side flips some top-k choices, as it does on real MoE models;
its experts' outputs are scaled up (and its output layer sharpened) so that a flipped choice moves the
logprobs by more than bf16 rounding does, as experts carry a real model's MLP. With
replay every router of the trainer takes the generator's experts at every position the generator ran
(prompt and completion, all but each sequence's last token); without, a measurable fraction of choices
differ (`routing_agreement` < 1), and the lag-0 logprob mismatch is larger than with replay.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.records import TrainSequence
from megatron_rl.rollout.routing import SERVER_FLAG, RoutingShape
from support.runs import running_generator
from support.train_models import make_served_tiny_moe

pytestmark = [pytest.mark.long, pytest.mark.e2e]

EXPERTS, TOPK, LAYERS = 32, 4, 2
PROMPTS = [[1, 40, 41, 42, 43], [1, 100, 7, 250, 9, 11, 12], [1, 60, 61, 5, 5, 80], [1, 33, 200, 17]]
SAMPLING = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def moe_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny MoE (32 experts of width 16, top-4; expert outputs x 20, output layer x 4) with the tiny
    Llama's tokenizer."""
    from safetensors.torch import load_file, save_file

    out = make_served_tiny_moe(tmp_path_factory.mktemp("replay_moe"), tiny_llama_dir, experts=EXPERTS, topk=TOPK,
                               expert_ffn=16)
    scale = {"down_proj.weight": 20.0, "lm_head.weight": 4.0}
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({n: t * next((v for k, v in scale.items() if n.endswith(k)), 1.0) for n, t in tensors.items()},
                  str(f), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def rollouts(moe_dir, tmp_path_factory):
    with running_generator(moe_dir, tmp_path_factory.mktemp("sglang_replay"), group_size=2, max_total_tokens=2048,
                           threads=1, startup_timeout_s=840, extra_args=[SERVER_FLAG, "--dtype", "bfloat16"]) as gen:
        gen.routing = RoutingShape.of_model(moe_dir)
        for i, prompt in enumerate(PROMPTS):
            gen.submit(f"p{i}", prompt, sampling=SAMPLING)
        return list(gen.completions(n=2 * len(PROMPTS), timeout=600))


def sequences(rollouts, replay: bool) -> list[TrainSequence]:
    return [TrainSequence(r.prompt_ids + r.completion_ids, len(r.prompt_ids), r.behaviour_logprobs,
                          advantage=float(i % 2) - 0.5, weight_versions=r.weight_versions, temperature=r.temperature,
                          routed_experts=r.routed_experts if replay else None) for i, r in enumerate(rollouts)]


def routing_maps(trainer, seqs) -> tuple[dict, list]:
    """`trainer.evaluate(seqs)` metrics, and each router's routing map [T, experts] of its forward."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps, hooks = [], []
    for m in trainer.model_chunks[0].modules():
        if isinstance(m, TopKRouter):
            hooks.append(m.register_forward_hook(lambda mod, args, out: maps.append((mod.layer_number - 1, out[1]))))
    try:
        return trainer.evaluate(seqs), maps
    finally:
        for h in hooks:
            h.remove()


def test_replay_gives_the_trainer_the_generators_experts(rollouts, moe_dir):
    from megatron_rl.train.packing import pack_sequences
    from support.policies import make_trainer

    assert all(r.routed_experts is not None for r in rollouts)
    for r in rollouts:  # every position but the last, one byte per id
        assert r.routed_experts.positions == len(r.prompt_ids) + len(r.completion_ids) - 1
        assert len(r.routed_experts.ids) == r.routed_experts.positions * LAYERS * TOPK
    trainer = make_trainer(moe_dir, algo={"routing_replay": True}, precision="bf16", micro_batch_tokens=512)
    replayed, maps = routing_maps(trainer, sequences(rollouts, replay=True))
    (mb,) = pack_sequences(sequences(rollouts, replay=True), 512).micro_batches
    given = mb.routed_experts[0, 0] >= 0
    assert int(given.sum()) == sum(r.routed_experts.positions for r in rollouts)
    for layer, routing_map in maps:
        expected = torch.zeros_like(routing_map).scatter(1, mb.routed_experts[layer].T.long().clamp(min=0), True)
        assert torch.equal(routing_map[given], expected[given]), f"layer {layer}"
    own, _ = routing_maps(trainer, sequences(rollouts, replay=False))
    lag0 = "mismatch/lag0/abs_mean"
    print(f"\nrouting agreement without replay {replayed['routing_agreement']:.4f}; lag-0 |d| mean "
          f"{own[lag0]:.4g} without replay, {replayed[lag0]:.4g} with; routes {routes_bytes(rollouts)} bytes")
    assert 0.5 < replayed["routing_agreement"] < 1.0  # bf16 flips some of the near-tied choices
    assert "routing_agreement" not in own  # nothing replayed: nothing to agree with
    assert replayed[lag0] < own[lag0]


def routes_bytes(rollouts) -> int:
    return sum(len(r.routed_experts.ids) for r in rollouts)
