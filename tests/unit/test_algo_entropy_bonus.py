"""The entropy bonus (`algo.entropy_coef`): in the pure loss and through the Megatron RL step.

References are independent of the code under test: the entropy is -(p log p).sum written out from
`torch.log_softmax`, the surrogate token by token, gradients by finite differences (float64) or by HF
transformers + autograd on unpacked sequences.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.algo.loss import clipped_token_loss
from test_train_step import (EPS_HIGH, EPS_LOW, SAME_LAYOUT, hf_completion_logprobs, hf_model,  # noqa: E402
                             make_config, make_minibatch)

pytestmark = pytest.mark.unit


def _inputs(seed: int = 0, b: int = 3, t: int = 5, v: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (b, t), generator=g)
    behaviour = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0] + 0.3 * torch.randn(
        b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0, 0] = True
    return logits, targets, behaviour, adv, mask


def _with_bonus(coef: float, targets, behaviour, adv, mask):
    def loss(logits):
        logp_all = torch.log_softmax(logits, -1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        logp = logp_all.gather(-1, targets[..., None])[..., 0]
        return clipped_token_loss(logp, behaviour, adv, mask, EPS_LOW, EPS_HIGH, entropy=entropy, entropy_coef=coef)
    return loss


def _reference(logits, targets, behaviour, adv, mask, coef: float) -> torch.Tensor:
    """Token by token: -min(r A, clip(r) A) - coef * H, summed over unmasked tokens / their count."""
    total, n = 0.0, 0
    for i in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not mask[i, t]:
                continue
            p = torch.softmax(logits[i, t], -1)
            h = -(p * p.log()).sum()
            r = torch.exp(p[targets[i, t]].log() - behaviour[i, t])
            surrogate = min(r * adv[i], r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv[i])
            total, n = total - surrogate - coef * h, n + 1
    return total / n


def test_bonus_value_and_gradient_in_the_pure_loss():
    logits, targets, behaviour, adv, mask = _inputs()
    coef = 0.37
    loss = _with_bonus(coef, targets, behaviour, adv, mask)
    assert float(loss(logits)) == pytest.approx(float(_reference(logits, targets, behaviour, adv, mask, coef)),
                                                rel=1e-12)
    # analytic gradient of the whole loss (surrogate + bonus) against finite differences
    assert torch.autograd.gradcheck(loss, (logits.clone().requires_grad_(),), eps=1e-6, atol=1e-7)


def test_bonus_maximises_entropy_and_zero_is_off():
    logits, targets, behaviour, adv, mask = _inputs(seed=1)
    off = _with_bonus(0.0, targets, behaviour, adv, mask)(logits)
    assert float(off) == pytest.approx(float(clipped_token_loss(
        torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0], behaviour, adv, mask,
        EPS_LOW, EPS_HIGH)), rel=1e-15)
    # with zero advantages only the bonus acts: a gradient-descent step raises the mean entropy
    x = logits.clone().requires_grad_()
    _with_bonus(1.0, targets, behaviour, torch.zeros_like(adv), mask)(x).backward()

    def mean_entropy(z):
        lp = torch.log_softmax(z, -1)
        return float((-(lp.exp() * lp).sum(-1))[mask].mean())
    assert mean_entropy(logits - 0.1 * x.grad) > mean_entropy(logits)


def test_bad_bonus_inputs_raise():
    logits, targets, behaviour, adv, mask = _inputs()
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    with pytest.raises(ValueError, match="needs entropy"):
        clipped_token_loss(logp, behaviour, adv, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match=">= 0"):
        clipped_token_loss(logp, behaviour, adv, mask, entropy=torch.ones_like(logp), entropy_coef=-0.1)


def _hf_reference(model, seqs, coef: float):
    """Loss and gradients by hand per unpacked sequence (HF autograd), the bonus included."""
    model.zero_grad()
    lens = torch.tensor([s.completion_len for s in seqs], dtype=torch.float64)
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float64)
    mean = (adv * lens).sum() / lens.sum()
    adv_n = ((adv - mean) / ((((adv - mean) ** 2) * lens).sum() / lens.sum()).sqrt()).float()
    n_tok = float(lens.sum())
    total = 0.0
    for s, a in zip(seqs, adv_n):
        lp, ent = hf_completion_logprobs(model, s, with_entropy=True)
        r = torch.exp(lp - torch.tensor(s.behaviour_logprobs))
        per_tok = -torch.minimum(r * a, r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a) - coef * ent
        total = total + per_tok.sum() / n_tok
    total.backward()
    return float(total), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("log_entropy", [True, False])
def test_step_with_bonus_matches_hf_reference(tiny_llama_dir, backend, log_entropy):
    """The fused loss (C++ extension and PyTorch backends) plus the separate entropy pass equal the
    reference; the bonus is applied whether or not the entropy metric is logged."""
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    coef = 0.5
    hf = hf_model(tiny_llama_dir)
    seqs = make_minibatch(hf)
    ref_loss, ref_grads = _hf_reference(hf, seqs, coef)
    trainer = Trainer(make_config(tiny_llama_dir, log_entropy=log_entropy))
    ctx = dataclasses.replace(trainer.ctx, algo=dataclasses.replace(trainer.ctx.algo, entropy_coef=coef))
    trainer.optimizer.zero_grad()
    out = forward_backward(trainer.model, seqs, ctx)
    assert out.n_micro_batches >= 3
    assert out.metrics["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-5)
    assert ("entropy" in out.metrics) == log_entropy
    params = dict(trainer.model_chunks[0].named_parameters())
    for meg, hf_name in SAME_LAYOUT.items():
        torch.testing.assert_close(params[meg].main_grad, ref_grads[hf_name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{meg}: {m}")
