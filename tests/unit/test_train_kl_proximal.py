"""Trainer-side logprobs on the tiny Llama against HF transformers + autograd references:
sampling temperature, KL to the frozen reference (k2 loss, KL in the reward, refresh, checkpoint), and
the decoupled objective with trainer-side proximal logprobs (tests/e2e/test_train_kl.py shows a large
kl_coef holding a trained policy near the reference).

The references never touch megatron_rl's step: HF models (the initial weights = the reference policy;
the current weights exported to HF = the policy), hand-written log_softmax(logits / T), and the
formulas of algo.loss / algo.kl on those explicit logprobs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.algo.kl import kl_k2_loss
from megatron_rl.algo.loss import clipped_token_loss
from megatron_rl.records import Batch, TrainSequence
from support.policies import EPS_HIGH, EPS_LOW, completion_logprobs, hf_model, hf_policy, make_trainer

OUTPUT, HF_OUTPUT = "output_layer.weight", "lm_head.weight"


def make_seqs(model, n=6, seed=0, temperature=1.0, noise=0.3, groups=None) -> list[TrainSequence]:
    """Sequences whose behaviour logprobs are HF's at `temperature` plus noise."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        p, c = 2 + i % 3, 3 + (5 * i) % 7
        ids = torch.randint(3, model.config.vocab_size, (p + c,), generator=g).tolist()
        s = TrainSequence(ids, p, [0.0] * c, advantage=float(torch.randn((), generator=g)),
                          temperature=temperature, group_id=f"g{i % groups}" if groups else "")
        with torch.no_grad():
            lp = completion_logprobs(model, s, temperature)
        s.behaviour_logprobs = (lp + noise * torch.randn(c, generator=g)).tolist()
        seqs.append(s)
    return seqs


def normalised(adv: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Token-weighted minibatch normalisation (Magistral), written out."""
    mean = (adv * lens).sum() / lens.sum()
    return (adv - mean) / ((((adv - mean) ** 2) * lens).sum() / lens.sum()).sqrt()


def reference_step(policy, seqs, advantages, temperature=1.0, proximal=None, tis_cap=None, ref=None,
                   kl_coef=0.0):
    """Loss and lm_head gradient of one minibatch, by hand on HF logprobs."""
    policy.zero_grad()
    n_tok = sum(s.completion_len for s in seqs)
    total = 0.0
    for k, (s, a) in enumerate(zip(seqs, advantages)):
        lp = completion_logprobs(policy, s, temperature)[None]
        prox = None if proximal is None else proximal[k][None]
        total = total + clipped_token_loss(lp, torch.tensor([s.behaviour_logprobs]), torch.tensor([float(a)]),
                                           torch.ones_like(lp, dtype=torch.bool), EPS_LOW, EPS_HIGH,
                                           normalizer=n_tok, proximal_logprobs=prox, tis_cap=tis_cap)
        if ref is not None:
            total = total + kl_coef * kl_k2_loss(lp, ref[k][None], torch.ones_like(lp, dtype=torch.bool),
                                                 normalizer=len(seqs))
    total.backward()
    return float(total), policy.lm_head.weight.grad.detach().clone()


def megatron_step(trainer, seqs):
    """Loss and output-layer gradient of the trainer's step on the same minibatch (no optimizer step)."""
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.update import prepare_update

    (prepared,) = prepare_update(trainer.model, trainer.reference, [seqs], trainer.ctx)
    trainer.optimizer.zero_grad()
    out = forward_backward(trainer.model, prepared, trainer.ctx)
    grad = dict(trainer.model_chunks[0].named_parameters())[OUTPUT].main_grad.detach().clone()
    return out, grad, prepared


def move_policy(trainer, model_dir, seed=5):
    """One plain RL update so the policy differs from its initial weights (= the reference)."""
    seqs = make_seqs(hf_model(model_dir), n=4, seed=seed, noise=0.0)
    trainer.train_on(Batch(seqs, n_mini=1, policy_version=0))


def test_temperature_scales_the_logits_like_the_sampler(tiny_llama_dir):
    """Behaviour logprobs of log_softmax(logits / 0.7) and no update yet: every ratio is 1, and loss and
    gradient equal the reference on tempered logits; scoring at T=1 would not give ratio 1."""
    hf = hf_model(tiny_llama_dir)
    seqs = make_seqs(hf, temperature=0.7, noise=0.0)
    trainer = make_trainer(tiny_llama_dir)
    out, grad, _ = megatron_step(trainer, seqs)
    assert out.metrics["ratio_min"] == pytest.approx(1.0, abs=2e-5)
    assert out.metrics["ratio_max"] == pytest.approx(1.0, abs=2e-5)
    lens = torch.tensor([s.completion_len for s in seqs], dtype=torch.float64)
    adv = normalised(torch.tensor([s.advantage for s in seqs], dtype=torch.float64), lens).float()
    loss, ref_grad = reference_step(hf, seqs, adv, temperature=0.7)
    assert out.metrics["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    untempered = [dataclasses.replace(s, temperature=1.0) for s in seqs]  # control: the bug it fixes
    out1, _, _ = megatron_step(trainer, untempered)
    assert abs(out1.metrics["ratio_max"] - 1.0) > 0.05 or abs(out1.metrics["ratio_min"] - 1.0) > 0.05


def test_k2_kl_loss_matches_reference_and_reference_stays_frozen(tiny_llama_dir):
    trainer = make_trainer(tiny_llama_dir, algo={"kl_mode": "k2", "kl_coef": 0.5})
    move_policy(trainer, tiny_llama_dir)
    init, policy = hf_model(tiny_llama_dir), hf_policy(trainer, tiny_llama_dir)
    seqs = make_seqs(init, seed=3)
    with torch.no_grad():
        ref_lp = [completion_logprobs(init, s) for s in seqs]  # reference = the initial weights
        pol_lp = [completion_logprobs(policy, s) for s in seqs]
    out, grad, prepared = megatron_step(trainer, seqs)
    lens = torch.tensor([s.completion_len for s in seqs], dtype=torch.float64)
    adv = normalised(torch.tensor([s.advantage for s in seqs], dtype=torch.float64), lens).float()
    loss, ref_grad = reference_step(policy, seqs, adv, ref=ref_lp, kl_coef=0.5)
    kl = sum(float((p - r).sum()) for p, r in zip(pol_lp, ref_lp)) / len(seqs)
    assert abs(kl) > 1e-3  # the policy really moved, so the KL term is not trivially 0
    assert out.metrics["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
    assert out.metrics["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    _, no_kl_grad = reference_step(policy, seqs, adv)
    assert (ref_grad - no_kl_grad).norm() > 1e-3 * ref_grad.norm()  # the KL term changes the gradient


def test_kl_in_the_reward_uses_a_leave_one_out_group_baseline(tiny_llama_dir):
    from megatron_rl.train.update import kl_reward_advantages

    coef = 2.0
    trainer = make_trainer(tiny_llama_dir, algo={"kl_mode": "reward", "kl_coef": coef})
    move_policy(trainer, tiny_llama_dir)
    init, policy = hf_model(tiny_llama_dir), hf_policy(trainer, tiny_llama_dir)
    seqs = make_seqs(init, n=6, seed=4, groups=2)
    seqs.append(dataclasses.replace(seqs[0], group_id="alone"))  # no group-mate in the batch: baseline 0
    with torch.no_grad():
        k1 = [float((completion_logprobs(policy, s) - completion_logprobs(init, s)).sum()) for s in seqs]
    expected = []
    for i, s in enumerate(seqs):
        mates = [k1[j] for j, t in enumerate(seqs) if t.group_id == s.group_id and j != i]
        expected.append(s.advantage - coef * (k1[i] - (sum(mates) / len(mates) if mates else 0.0)))
    assert kl_reward_advantages(seqs, k1, coef) == pytest.approx(expected, rel=1e-9)
    lens = torch.tensor([s.completion_len for s in seqs], dtype=torch.float64)
    adv = normalised(torch.tensor(expected, dtype=torch.float64), lens).float()
    out, grad, prepared = megatron_step(trainer, seqs)
    got = {}
    for mb in prepared.packed.micro_batches:
        # kept for k1 and the mismatch metrics; the loss's ratio stays on the behaviour logprobs (step.py)
        assert mb.proximal_logprobs is not None
        for j, local in enumerate(mb.seq_indices):
            sel = (mb.segment_ids == j) & (mb.loss_mask[0] > 0)
            got[prepared.share[local]] = float(mb.advantages[0, sel][0])
    assert [got[i] for i in range(len(seqs))] == pytest.approx(adv.tolist(), rel=1e-4, abs=1e-5)
    loss, ref_grad = reference_step(policy, seqs, adv)
    assert out.metrics["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_decoupled_objective_anchors_on_trainer_logprobs(tiny_llama_dir):
    """proximal: trainer: the ratio is against the trainer's logprobs of the update-start weights (1 at
    the first step), the behaviour mismatch a truncated weight; equal to algo.loss on HF logprobs."""
    trainer = make_trainer(tiny_llama_dir, algo={"proximal": "trainer", "tis_cap": 1.5})
    move_policy(trainer, tiny_llama_dir)
    policy = hf_policy(trainer, tiny_llama_dir)
    seqs = make_seqs(hf_model(tiny_llama_dir), seed=6, noise=0.5)  # stale: behaviour = initial weights + noise
    with torch.no_grad():
        prox = [completion_logprobs(policy, s) for s in seqs]
    out, grad, _ = megatron_step(trainer, seqs)
    assert out.metrics["ratio_min"] == pytest.approx(1.0, abs=2e-5)
    assert out.metrics["ratio_max"] == pytest.approx(1.0, abs=2e-5)
    lens = torch.tensor([s.completion_len for s in seqs], dtype=torch.float64)
    adv = normalised(torch.tensor([s.advantage for s in seqs], dtype=torch.float64), lens).float()
    loss, ref_grad = reference_step(policy, seqs, adv, proximal=prox, tis_cap=1.5)
    assert out.metrics["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    w = torch.cat([torch.exp(p - torch.tensor(s.behaviour_logprobs)).clamp_max(1.5) for p, s in zip(prox, seqs)])
    assert out.metrics["is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-4)
    assert float(w.min()) < 0.9  # the weights are not all 1: the behaviour really was stale


def test_reference_refresh_and_checkpoint(tiny_llama_dir, tmp_path):
    trainer = make_trainer(tiny_llama_dir, algo={"kl_mode": "k2", "kl_coef": 0.1, "kl_ref_refresh_every": 2})
    seqs = make_seqs(hf_model(tiny_llama_dir), n=4, seed=7, noise=0.0)
    for v in range(3):
        trainer.train_on(Batch(seqs, n_mini=1, policy_version=v))
    assert trainer.reference.version == 2  # refreshed after update 2, not after 1 or 3
    ref_state = {k: v.clone() for k, v in trainer.reference.chunks[0].state_dict().items() if torch.is_tensor(v)}
    policy_out = dict(trainer.model_chunks[0].named_parameters())[OUTPUT].detach()
    assert not torch.equal(ref_state[OUTPUT], policy_out)
    trainer.save(tmp_path / "ckpt")
    fresh = make_trainer(tiny_llama_dir, algo={"kl_mode": "k2", "kl_coef": 0.1, "kl_ref_refresh_every": 2})
    assert not torch.equal(fresh.reference.chunks[0].state_dict()[OUTPUT], ref_state[OUTPUT])
    fresh.load(tmp_path / "ckpt")
    assert fresh.reference.version == 2
    for k, v in fresh.reference.chunks[0].state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, ref_state[k]), k
