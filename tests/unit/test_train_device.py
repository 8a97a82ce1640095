"""Device discipline on CPU: the helper that names the model's device, micro-batches moved there whole,
and every tensor a step hands to the loss or to a collective living on the model's device."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.records import Batch, TrainSequence
from megatron_rl.train.device import model_device
from megatron_rl.train.packing import PackedMicroBatch, pack_sequences
from support.policies import make_trainer


def test_model_device_is_the_device_of_a_parameter():
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 3)
    assert model_device(meta) == torch.device("meta")
    assert model_device([torch.nn.Identity(), meta]) == torch.device("meta")  # a chunk without params
    assert model_device([torch.nn.Linear(2, 2)]) == torch.device("cpu")
    with pytest.raises(ValueError, match="no parameters"):
        model_device([torch.nn.Identity()])


def _tensor_fields(mb: PackedMicroBatch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)
            if isinstance(getattr(mb, f.name), torch.Tensor)}


def test_micro_batch_moves_whole_and_its_helpers_build_on_its_device():
    seqs = [TrainSequence([5, 6, 7, 8], 2, [-1.0, -2.0], advantage=0.5, temperature=0.7),
            TrainSequence([9, 10, 11], 1, [-0.5, -0.25], advantage=-1.0)]
    mb = pack_sequences(seqs, capacity=16, pad_multiple=8).micro_batches[0]
    mb.proximal_logprobs = torch.zeros_like(mb.behaviour_logprobs)
    mb.ref_logprobs = torch.ones_like(mb.behaviour_logprobs)
    assert mb.to("cpu") is mb  # already there: no copy
    moved = mb.to("meta")
    fields = _tensor_fields(moved)
    assert {"temperature", "proximal_logprobs", "ref_logprobs", "cu_seqlens"} <= set(fields)
    assert all(t.device.type == "meta" for t in fields.values()), {k: t.device for k, t in fields.items()}
    assert moved.device == torch.device("meta") and moved.seq_indices == mb.seq_indices
    assert moved.n_real_tokens == mb.n_real_tokens
    assert all(t.device.type == "cpu" for t in _tensor_fields(mb).values())  # the original is untouched
    # the helpers the step and the update call create their tensors on the batch's device
    assert moved.attention_mask().device.type == "meta"
    moved.set_advantages([1.0, 2.0])
    assert moved.advantages.device.type == "meta"


def test_an_rl_update_keeps_every_tensor_on_the_model_device(tiny_llama_dir, monkeypatch):
    """Proximal and reference passes, KL in the reward, the loss and the metric reductions: everything
    the loss sees and every collective the step and the update send lives on the model's device (the
    CPU here; tests/unit/test_train_step_cuda.py checks CUDA)."""
    from megatron_rl.train import step
    from support.collectives import spy_collectives

    trainer = make_trainer(tiny_llama_dir, algo={"kl_mode": "reward", "kl_coef": 0.1, "proximal": "trainer",
                                                 "tis_cap": 2.0})
    device = model_device(trainer.model)
    seen: dict[str, list] = {"loss": [], "logprobs": [], "collective": []}
    loss_func, store = step._loss_func, step._store_logprobs

    def spy_loss(mb, ctx, objective, output):
        seen["loss"].append([output.device] + [t.device for t in _tensor_fields(mb).values()])
        loss, count, stats = loss_func(mb, ctx, objective, output)
        seen["loss"][-1] += [loss.device, count.device] + [t.device for t in stats.values()]
        return loss, count, stats

    def spy_store(mb, positions, ctx, field, output):
        seen["logprobs"].append([output.device] + [t.device for t in _tensor_fields(mb).values()]
                                + ([] if positions is None else [positions.device]))
        loss, count, stats = store(mb, positions, ctx, field, output)
        seen["logprobs"][-1] += [loss.device, count.device, getattr(mb, field).device]
        return loss, count, stats

    monkeypatch.setattr(step, "_loss_func", spy_loss)
    monkeypatch.setattr(step, "_store_logprobs", spy_store)
    spy_collectives(monkeypatch, seen["collective"])
    g = torch.Generator().manual_seed(0)
    seqs = [TrainSequence(torch.randint(3, trainer.dims.vocab_size, (4 + i,), generator=g).tolist(), 2, [-1.0] * (2 + i),
                          advantage=float(i % 2), group_id=f"g{i % 2}") for i in range(4)]
    out = trainer.train_on(Batch(seqs, n_mini=1, policy_version=0))
    assert out["n_loss_tokens"] > 0
    assert seen["loss"] and seen["logprobs"] and seen["collective"]
    for kind in ("loss", "logprobs"):
        for devices in seen[kind]:
            assert set(devices) == {device}, (kind, devices)
    assert {d for _, d in seen["collective"]} == {device}, seen["collective"]
