"""Routing replay in the trainer (train/routing_replay.py) on a tiny Qwen3-MoE, one process, fp32.

The reference is HF transformers with each MoE block's router forced onto the same experts (its own
softmax over all experts, gathered at the given ids and renormalised: HF's arithmetic, not Megatron's
softmax over the chosen logits), one sequence at a time: the trainer's packed bin with replay must give
its logprobs and router gradients. Positions without routes (each sequence's last token, a sequence
without any) take the router's own top-k. Full recompute replays the same experts in the backward
(Megatron's queue), so its gradients equal those without recompute.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.records import RoutedExperts, TrainSequence
from support.train_models import make_tiny_moe

LAYERS, EXPERTS, TOPK = 2, 4, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("replay_moe"), experts=EXPERTS, topk=TOPK)


def random_routes(n_positions: int, seed: int) -> torch.Tensor:
    """[positions, layers, topk] distinct expert ids per row, drawn at random (not the router's choice)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n_positions * LAYERS)]).view(
        n_positions, LAYERS, TOPK)


def record(routes: torch.Tensor) -> RoutedExperts:
    return RoutedExperts(routes.to(torch.uint8).numpy().tobytes(), LAYERS, TOPK, 1)


def sequences() -> list[TrainSequence]:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(3, 300, (13,), generator=g).tolist(), torch.randint(3, 300, (9,), generator=g).tolist()
    return [TrainSequence(a, 4, [0.0] * 9, 1.0, routed_experts=record(random_routes(12, 0))),
            TrainSequence(b, 3, [0.0] * 6, -1.0)]  # no routes: the trainer routes it by itself


def forced_hf(moe_dir, routes: torch.Tensor | None):
    """HF's model whose routers take `routes` ([T-1, layers, topk]) at every position but the last."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    if routes is None:
        return hf
    for layer, decoder in enumerate(hf.model.layers):
        gate = decoder.mlp.gate

        def forward(hidden, gate=gate, given=routes[:, layer].long()):
            logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            idx = torch.topk(probs, gate.top_k, dim=-1).indices
            idx = torch.cat([given, idx[len(given):]])  # the last position: its own top-k
            weights = probs.gather(1, idx)
            return logits, weights / weights.sum(-1, keepdim=True), idx

        gate.forward = forward
    return hf


def hf_logprobs(hf, seq: TrainSequence) -> torch.Tensor:
    ids = torch.tensor([seq.token_ids])
    logp = torch.log_softmax(hf(ids).logits.float()[0, :-1], -1)
    return logp.gather(-1, ids[0, 1:, None]).squeeze(-1)


def trainer_logprobs(chunk, seqs, replay: bool) -> tuple[torch.Tensor, tuple[int, int]]:
    """Per-position logprobs of the packed bin (replaying the routes when `replay`) and the agreement."""
    import dataclasses

    from megatron_rl.train import routing_replay
    from megatron_rl.train.logprobs import token_logprobs
    from megatron_rl.train.packing import pack_sequences

    (mb,) = pack_sequences(seqs, capacity=64, pad_multiple=8).micro_batches
    if not replay:
        mb = dataclasses.replace(mb, routed_experts=None)
    with routing_replay.replaying([chunk]):
        routing_replay.set_targets(chunk, mb)
        logits = chunk(mb.tokens, mb.position_ids, mb.attention_mask())
    return token_logprobs(logits, mb.labels, None, 301)[0], routing_replay.agreement([chunk])


def test_replayed_forward_equals_hf_forced_onto_the_same_experts(moe_dir, tp1):
    from transformers import AutoConfig

    from megatron_rl.train.hf_weights import load_hf_weights
    from megatron_rl.train.model import build_model
    from megatron_rl.train.packing import routes_tensor

    (chunk,) = build_model(AutoConfig.from_pretrained(moe_dir), tp1, torch.float32, use_te=False, routing_replay=True)
    load_hf_weights([chunk], moe_dir)
    a, b = sequences()
    got, (agreed, replayed) = trainer_logprobs(chunk, [a, b], replay=True)
    routes = routes_tensor(a.routed_experts)
    n_a = len(a.token_ids)
    torch.testing.assert_close(got[:n_a - 1], hf_logprobs(forced_hf(moe_dir, routes), a), atol=2e-5, rtol=0)
    torch.testing.assert_close(got[n_a:n_a + len(b.token_ids) - 1], hf_logprobs(forced_hf(moe_dir, None), b),
                               atol=2e-5, rtol=0)
    # the random routes are not the router's own: replay changed the output, and the agreement counts
    # exactly the rows whose own top-k HF also finds equal to them
    natural, (_, none_replayed) = trainer_logprobs(chunk, [a, b], replay=False)
    assert (natural[:n_a - 1] - got[:n_a - 1]).abs().max() > 1e-3 and none_replayed == 0
    assert replayed == (n_a - 1) * LAYERS
    assert agreed == own_agreement(moe_dir, chunk, a, routes)


def own_agreement(moe_dir, chunk, seq, routes) -> int:
    """Rows (position, layer) of `routes` equal, as sets, to the router's own top-k under the replay
    (the router's input at layer 2 depends on layer 1's replayed experts: HF forced, hooks on the gates)."""
    hf = forced_hf(moe_dir, routes)
    own = []
    for decoder in hf.model.layers:
        decoder.mlp.gate.register_forward_hook(
            lambda m, args, out: own.append(torch.topk(out[0], TOPK, dim=-1).indices))
    hf(torch.tensor([seq.token_ids]))
    same = [(o[:-1].sort(-1).values == routes[:, layer].long().sort(-1).values).all(-1) for layer, o in enumerate(own)]
    return int(torch.stack(same).sum())


def replay_step(moe_dir, seqs, monkeypatch, **trainer_keys):
    """Metrics, main grads and the replay action of every routing of one RL forward_backward with routing
    replay on."""
    from megatron_rl.config import config_from_dict
    from megatron_rl.train.routing_replay import TokenReplay
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    actions = []
    original = TokenReplay.get_replay_topk

    def recorded(self, *args, **kwargs):
        actions.append(self.router_replay_action.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TokenReplay, "get_replay_topk", recorded)

    cfg = config_from_dict({"trainer": {"model": str(moe_dir), "precision": "fp32", "micro_batch_tokens": 16,
                                        "grad_clip": 1e6, **trainer_keys},
                            "algo": {"routing_replay": True}})
    trainer = Trainer(cfg)
    trainer.optimizer.zero_grad()
    out = forward_backward(trainer.model, seqs, trainer.ctx)
    return out, {n: p.main_grad.detach().clone() for n, p in trainer.model_chunks[0].named_parameters()}, actions


def test_full_recompute_replays_each_micro_batch_in_the_backward(moe_dir, monkeypatch):
    """Two bins (capacity 16): the recompute in each backward takes its own bin's routes from the queue
    (REPLAY_BACKWARD); the router weights get their gradient through the replayed experts' logits."""
    seqs = sequences()
    base, base_grads, base_actions = replay_step(moe_dir, seqs, monkeypatch)
    assert base.n_micro_batches == 2 and base_actions == ["REPLAY_FORWARD"] * 2 * LAYERS
    assert 0 < base.metrics["routing_agreement"] < 1
    full, grads, actions = replay_step(moe_dir, seqs, monkeypatch, recompute="full")
    assert actions == (["REPLAY_FORWARD"] * LAYERS + ["REPLAY_BACKWARD"] * LAYERS) * 2
    assert full.metrics["loss"] == pytest.approx(base.metrics["loss"], rel=1e-6)
    assert full.metrics["routing_agreement"] == base.metrics["routing_agreement"]
    routers = [n for n in grads if n.endswith("router.weight")]
    assert len(routers) == LAYERS and all(base_grads[n].abs().sum() > 0 for n in routers)
    for name, g in grads.items():
        torch.testing.assert_close(g, base_grads[name], rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")


def test_a_dense_model_is_refused_before_launch_naming_the_key(tiny_llama_dir, moe_dir):
    from megatron_rl.config import ConfigError, config_from_dict
    from megatron_rl.control.preflight import check_model

    def config(model):
        return config_from_dict({"trainer": {"model": str(model), "precision": "fp32"}, "algo": {"routing_replay": True}})

    with pytest.raises(ConfigError, match=r"^algo\.routing_replay: trainer\.model is a dense llama model"):
        check_model(config(tiny_llama_dir))
    check_model(config(moe_dir))
