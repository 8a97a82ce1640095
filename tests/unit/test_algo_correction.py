"""Importance-sampling corrections (algo.is_correction) against formulas written out token by token.

The reference below never calls megatron_rl: per token it forms the ratio, the corrected weight
(truncated, masked outside the band, or the sequence's truncated geometric-mean ratio), the clipped
surrogate and the token-normalised sum, in float64 with autograd through log_softmax(logits). The
reference loss (algo.loss) and the fused op (ops, C++ extension and PyTorch path) must give the same
value and gradient on packed rows (several sequences per row, padding masked).
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algo.correction import ISCorrection, anchored_factor, is_correction
from megatron_rl.algo.loss import clipped_token_loss, clipped_token_loss_with_stats
from megatron_rl.config import ConfigError, config_from_dict
from megatron_rl.ops import fused_clipped_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28
CORRECTIONS = [ISCorrection("token_tis", cap=1.5), ISCorrection("token_tis"),
               ISCorrection("token_mask", low=0.6, high=1.7), ISCorrection("sequence_tis", cap=1.3),
               ISCorrection("sequence_tis")]


def make_rows(seed=0, B=2, T=14, V=53):
    """Two packed rows of 3 sequences each (segments 0..2) and trailing padding (segment 3, masked);
    behaviour and proximal logprobs off the exact ones by up to ~e^1 so every regime occurs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2.0
    targets = torch.randint(0, V, (B, T), generator=g)
    segments = torch.tensor([[0] * 4 + [1] * 5 + [2] * 3 + [3] * 2, [0] * 3 + [1] * 3 + [2] * 6 + [3] * 2])
    mask = segments < 3
    mask[:, 0] = False  # a prompt position inside a sequence
    exact = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    behaviour = (exact + torch.randn(B, T, generator=g)).float()
    proximal = (exact + 0.3 * torch.randn(B, T, generator=g)).float()
    adv = torch.randn(B, T, generator=g).float()
    return logits, targets, behaviour, proximal, adv, mask, segments


def reference(logits, targets, behaviour, proximal, adv, mask, segments, corr: ISCorrection):
    """Loss and d loss / d logits, token by token."""
    z = logits.double().clone().requires_grad_(True)
    lp = torch.log_softmax(z, -1).gather(-1, targets[..., None])[..., 0]
    B, T = mask.shape
    n = int(mask.sum())
    geo = {}  # (row, segment) -> geometric mean of exp(proximal - behaviour) over the sequence
    for b in range(B if proximal is not None else 0):
        for s in set(segments[b].tolist()):
            logs = [float(proximal[b, t]) - float(behaviour[b, t]) for t in range(T)
                    if mask[b, t] and int(segments[b, t]) == s]
            if logs:
                geo[b, s] = math.exp(sum(logs) / len(logs))
    total = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            a = float(adv[b, t])
            anchor = float(behaviour[b, t]) if proximal is None else float(proximal[b, t])
            r = torch.exp(lp[b, t] - anchor)
            rv = float(r.detach())
            if proximal is None:  # the ratio carries rho; weight c / r
                if corr.kind == "token_mask":
                    w = 1.0 if corr.low <= rv <= corr.high else 0.0
                else:
                    w = 1.0 if corr.cap is None else min(1.0, corr.cap / rv)
            else:
                rho = math.exp(float(proximal[b, t]) - float(behaviour[b, t]))
                if corr.kind == "token_tis":
                    w = rho if corr.cap is None else min(rho, corr.cap)
                elif corr.kind == "token_mask":
                    w = rho if corr.low <= rho <= corr.high else 0.0
                else:
                    g_ = geo[b, int(segments[b, t])]
                    w = g_ if corr.cap is None else min(g_, corr.cap)
            lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
            if (a > 0 and rv > hi) or (a < 0 and rv < lo):  # clipped: a constant, no gradient
                total = total + w * (-min(max(rv, lo), hi) * a)
            else:
                total = total + w * (-r * a)
    loss = total / n
    loss.backward()
    return float(loss), z.grad


# sequence_tis needs the proximal logprobs (test_bad_settings_are_refused)
CASES = [(c, True) for c in CORRECTIONS] + [(c, False) for c in CORRECTIONS if c.kind != "sequence_tis"]


@pytest.mark.parametrize("corr,anchored", CASES,
                         ids=[f"{c.kind}-{c.cap}-{'proximal' if a else 'behaviour'}" for c, a in CASES])
def test_correction_matches_token_by_token_reference(backend, corr, anchored):
    logits, targets, behaviour, proximal, adv, mask, segments = make_rows()
    prox = proximal if anchored else None
    want, want_grad = reference(logits, targets, behaviour, prox, adv, mask, segments, corr)
    z = logits.clone().requires_grad_(True)
    loss = fused_clipped_loss(z, targets, behaviour, adv, mask, EPS_LOW, EPS_HIGH, proximal_logprobs=prox,
                              correction=corr, segment_ids=segments)
    loss.backward()
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(z.grad.double(), want_grad, rtol=1e-4, atol=1e-6)
    # the reference loss of algo/ on the explicit logprobs agrees too
    zr = logits.double().clone().requires_grad_(True)
    lp = torch.log_softmax(zr, -1).gather(-1, targets[..., None])[..., 0]
    ref = clipped_token_loss(lp, behaviour.double(), adv.double(), mask, EPS_LOW, EPS_HIGH,
                             proximal_logprobs=None if prox is None else prox.double(), correction=corr,
                             segment_ids=segments)
    ref.backward()
    assert float(ref) == pytest.approx(want, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(zr.grad, want_grad, rtol=1e-7, atol=1e-10)


def test_masked_tokens_are_counted():
    logits, targets, behaviour, proximal, adv, mask, segments = make_rows()
    corr = ISCorrection("token_mask", low=0.6, high=1.7)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    _, st = clipped_token_loss_with_stats(lp, behaviour, adv, mask, EPS_LOW, EPS_HIGH, proximal_logprobs=proximal,
                                          correction=corr)
    rho = torch.exp(proximal.double() - behaviour.double())[mask]
    out = ((rho < 0.6) | (rho > 1.7)).double().mean()
    assert 0 < float(out) < 1  # the case really masks some tokens and keeps others
    assert float(st.is_masked_frac) == pytest.approx(float(out))


def test_each_config_key_changes_the_gradient(backend):
    """is_correction, tis_cap and the mask band each change the loss gradient on the same input."""
    logits, targets, behaviour, proximal, adv, mask, segments = make_rows(seed=3)

    def grad(**algo):
        cfg = config_from_dict({"algo": {"proximal": "trainer", **algo}})
        z = logits.clone().requires_grad_(True)
        fused_clipped_loss(z, targets, behaviour, adv, mask, EPS_LOW, EPS_HIGH, proximal_logprobs=proximal,
                           correction=is_correction(cfg.algo), segment_ids=segments).backward()
        return z.grad

    variants = [grad(), grad(tis_cap=1.2), grad(is_correction="token_mask"),
                grad(is_correction="token_mask", mask_ratio_low=0.8),
                grad(is_correction="token_mask", mask_ratio_high=1.2),
                grad(is_correction="sequence_tis"), grad(is_correction="sequence_tis", tis_cap=1.1)]
    for i in range(len(variants)):
        for j in range(i):
            assert not torch.allclose(variants[i], variants[j]), (i, j)


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="algo.is_correction"):
        config_from_dict({"algo": {"is_correction": "sequence_tis"}})  # needs proximal: trainer
    with pytest.raises(ConfigError, match="algo.tis_cap"):
        config_from_dict({"algo": {"is_correction": "token_mask", "tis_cap": 2.0}})
    with pytest.raises(ConfigError, match="algo.mask_ratio_low"):
        config_from_dict({"algo": {"mask_ratio_low": 1.5}})
    with pytest.raises(ConfigError, match="rollout.stale_policy"):
        config_from_dict({"algo": {"proximal": "trainer"}, "rollout": {"stale_policy": "reweight"}})
    config_from_dict({"algo": {"proximal": "trainer", "is_correction": "token_mask"},
                      "rollout": {"stale_policy": "reweight"}})  # the band bounds the weights
    logits, targets, behaviour, _, adv, mask, segments = make_rows()
    with pytest.raises(ValueError, match="sequence_tis needs the proximal"):
        clipped_token_loss(logits[..., 0], behaviour, adv, mask, correction=ISCorrection("sequence_tis"))
    with pytest.raises(ValueError, match="not both"):
        clipped_token_loss(logits[..., 0], behaviour, adv, mask, tis_cap=2.0, correction=ISCorrection())


def test_sequence_tis_of_a_packed_episode_averages_its_model_tokens_only():
    """An episode's environment tokens (loss_mask 0) are context: they weigh in neither its sequence
    ratio nor the loss, after packing beside a single-turn sequence."""
    from megatron_rl.records import ENV_LOGPROB, TrainSequence
    from megatron_rl.train.packing import pack_sequences

    g = torch.Generator().manual_seed(3)
    episode_mask = [1, 1, 1, 0, 0, 0, 1, 1, 0, 1]
    beh = [ENV_LOGPROB if not m else -float(x) for m, x in zip(episode_mask, torch.rand(10, generator=g))]
    episode = TrainSequence(list(range(1, 15)), 4, beh, 1.0, loss_mask=episode_mask)
    plain = TrainSequence(list(range(20, 27)), 3, [-0.5, -0.7, -0.2, -0.9], -1.0)
    (mb,) = pack_sequences([episode, plain], capacity=64).micro_batches
    proximal = mb.behaviour_logprobs + 0.3 * torch.randn(mb.behaviour_logprobs.shape, generator=g)
    mask = mb.loss_mask > 0
    factor = anchored_factor(proximal - mb.behaviour_logprobs, mask, ISCorrection("sequence_tis", cap=100.0),
                             mb.segment_ids.unsqueeze(0))
    for seg, n in ((0, sum(episode_mask)), (1, 4)):
        where = mask[0] & (mb.segment_ids == seg)
        assert int(where.sum()) == n  # the episode's model tokens, not its 4 environment tokens
        log_rho = (proximal - mb.behaviour_logprobs)[0][where].double()
        expected = torch.exp(log_rho.mean()).item()  # geometric mean of the ratios over those tokens
        assert torch.allclose(factor[0][where].double(), torch.full((n,), expected, dtype=torch.float64), rtol=1e-5)
    assert torch.all(factor[~mask] == 0)
