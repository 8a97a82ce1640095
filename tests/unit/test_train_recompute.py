"""Activation recompute (trainer.recompute): the RL step's loss and every gradient equal those of
`none`, and the recompute really happens (the core attention runs again in the backward).

The reference is the same step without recompute, itself checked against HF autograd in
tests/unit/test_train_step.py. Recompute re-runs the same float32 kernels on the same inputs, so
the agreement is to float32 rounding of the accumulation order (rtol 1e-6).
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.train.attention import SegmentCausalAttention

from unit.test_train_step import hf_model, make_config, make_minibatch

MODES = {  # name -> trainer keys
    "selective": {"recompute": "selective"},
    "full_uniform": {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full_uniform2": {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full_block1": {"recompute": "full", "recompute_method": "block", "recompute_num_layers": 1},
}


def _step(model_dir, seqs, monkeypatch, **trainer_keys):
    """Loss, metrics, main grads and core-attention forward count of one forward_backward."""
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    calls = []
    original = SegmentCausalAttention.forward

    def counting(self, *args, **kwargs):
        calls.append(self.layer_number)
        return original(self, *args, **kwargs)

    trainer = Trainer(make_config(model_dir, **trainer_keys))
    monkeypatch.setattr(SegmentCausalAttention, "forward", counting)
    trainer.optimizer.zero_grad()
    out = forward_backward(trainer.model, seqs, trainer.ctx)
    monkeypatch.setattr(SegmentCausalAttention, "forward", original)
    grads = {n: p.main_grad.detach().clone() for n, p in trainer.model_chunks[0].named_parameters()}
    return out, grads, calls


def test_recompute_modes_give_the_gradients_of_none_and_recompute_attention(tiny_llama_dir, monkeypatch):
    seqs = make_minibatch(hf_model(tiny_llama_dir))
    base, base_grads, base_calls = _step(tiny_llama_dir, seqs, monkeypatch)
    n_mb = base.n_micro_batches
    assert n_mb >= 3
    # without recompute: one core-attention forward per layer per micro-batch (2 layers); the entropy
    # pass is a separate no-grad read of the logits, not another model forward
    assert len(base_calls) == 2 * n_mb
    for name, keys in MODES.items():
        out, grads, calls = _step(tiny_llama_dir, seqs, monkeypatch, **keys)
        assert out.metrics["loss"] == pytest.approx(base.metrics["loss"], rel=1e-6), name
        assert grads.keys() == base_grads.keys()
        for param, g in grads.items():
            torch.testing.assert_close(g, base_grads[param], rtol=1e-6, atol=1e-8, msg=lambda m: f"{name} {param}: {m}")
        # each recomputed layer runs its core attention again in the backward: block recomputes only
        # the first layer of the stage, the others every layer
        again = 1 if keys.get("recompute_method") == "block" else 2
        assert len(calls) == (2 + again) * n_mb, (name, calls)


def test_recompute_keys_are_checked():
    from megatron_rl.config import config_from_dict

    with pytest.raises(ConfigError, match="trainer.recompute"):
        config_from_dict({"trainer": {"recompute": "partial"}})
    with pytest.raises(ConfigError, match="trainer.recompute_num_layers"):
        config_from_dict({"trainer": {"recompute": "full", "recompute_num_layers": 0}})
    with pytest.raises(ConfigError, match="trainer.sequence_parallel: needs tensor_parallel > 1"):
        config_from_dict({"trainer": {"sequence_parallel": True}})


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_finished_moe_step_keeps_no_autograd_graph(tmp_path, monkeypatch, recompute):
    """Megatron's token dispatcher keeps the routing probabilities of the last pass on itself; with their
    autograd graph (under full recompute: each layer's re-run input and its gradient) they would stay
    alive until the next forward. After forward_backward no tensor of a graph may be left."""
    import gc

    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer
    from support.train_models import make_tiny_moe

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # a process-wide scale Megatron sets once and then copies into: an earlier test's step may have left
    # a 0-d one, where this trainer's schedule passes a [1]-shaped one
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    folder = make_tiny_moe(tmp_path / "moe", family="qwen3_moe", experts=4, topk=2)
    def graph_tensors() -> list[torch.Tensor]:
        gc.collect()
        return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.grad_fn is not None]

    trainer = Trainer(make_config(folder, recompute=recompute))
    seqs = make_minibatch(hf_model(folder))
    before = {id(t) for t in graph_tensors()}  # the model's own parameter views (SliceBackward)
    forward_backward(trainer.model, seqs, trainer.ctx)
    left = [t for t in graph_tensors() if id(t) not in before]
    assert left == [], [(tuple(t.shape), type(t.grad_fn).__name__) for t in left]
