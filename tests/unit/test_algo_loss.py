"""clipped_token_loss against independent references: a scalar loop, finite differences, and the
full-minibatch loss for micro-batch / data-parallel accumulation."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algo.loss import (aggregate, clipped_token_loss, clipped_token_loss_with_stats,
                                   token_loss_terms)

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _batch(B=5, T=9, seed=0, dtype=torch.float64, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    behaviour = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    logprobs = behaviour + spread * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, generator=g, dtype=dtype)
    return logprobs, behaviour, adv, mask


def _loop_reference(logprobs, behaviour, adv, mask, eps_low, eps_high, level="token"):
    """Scalar Python transcription of the formula in DESIGN.md (no tensor ops)."""
    B, T = logprobs.shape
    seq_losses, seq_lens, total, count = [], [], 0.0, 0
    for i in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if not mask[i, t]:
                continue
            a = float(adv[i]) if adv.dim() == 1 else float(adv[i, t])
            r = math.exp(float(logprobs[i, t]) - float(behaviour[i, t]))
            rc = min(max(r, 1 - eps_low), 1 + eps_high)
            s += -min(r * a, rc * a)
            n += 1
        seq_losses.append(s)
        seq_lens.append(n)
        total += s
        count += n
    if level == "token":
        return total / count
    kept = [s / n for s, n in zip(seq_losses, seq_lens) if n > 0]
    return sum(kept) / len(kept)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("token_adv", [False, True])
def test_value_matches_scalar_loop(level, token_adv):
    lp, b, adv, mask = _batch(seed=1)
    if token_adv:
        adv = adv[:, None] + 0.1 * torch.randn(lp.shape, dtype=lp.dtype)
    got = clipped_token_loss(lp, b, adv, mask, EPS_LOW, EPS_HIGH, level=level)
    assert got.item() == pytest.approx(_loop_reference(lp, b, adv, mask, EPS_LOW, EPS_HIGH, level), rel=1e-12)


def _away_from_kinks(lp, b, mask, margin=1e-3):
    r = torch.exp(lp - b)
    return bool(((r - (1 - EPS_LOW)).abs()[mask] > margin).all() and ((r - (1 + EPS_HIGH)).abs()[mask] > margin).all())


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradient_matches_finite_differences(level):
    lp, b, adv, mask = _batch(seed=2, spread=0.5)
    assert _away_from_kinks(lp, b, mask)  # the loss is piecewise smooth; FD is valid off the kinks
    lp.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: clipped_token_loss(x, b, adv, mask, EPS_LOW, EPS_HIGH, level=level), (lp,),
        eps=1e-6, atol=1e-8)


def test_gradient_is_zero_exactly_on_clipped_tokens_and_padding():
    lp = torch.tensor([[0.5, -0.5, 0.0, 0.05, float("nan")]], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, 5, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    for a in (1.0, -1.0):
        lp.grad = None
        clipped_token_loss(lp, b, torch.tensor([a], dtype=torch.float64), mask).backward()
        r = torch.exp(lp.detach()[0, :4])
        expect = -a * r / 4  # d(-r a)/d logp = -r a, divided by 4 tokens
        if a > 0:
            expect[0] = 0.0  # r = e^0.5 > 1.28 with A > 0: clipped
        else:
            expect[1] = 0.0  # r = e^-0.5 < 0.8 with A < 0: clipped
        torch.testing.assert_close(lp.grad[0, :4], expect)
        assert lp.grad[0, 4] == 0.0 and not torch.isnan(lp.grad).any()


def test_stats_match_definitions():
    lp, b, adv, mask = _batch(B=16, T=12, seed=3, spread=0.6, dtype=torch.float32)
    loss, st = clipped_token_loss_with_stats(lp, b, adv, mask, EPS_LOW, EPS_HIGH)
    r = torch.exp(lp - b)[mask]
    a = adv[:, None].expand_as(lp)[mask]
    assert st.n_tokens.item() == mask.sum().item()
    assert st.clip_frac_low.item() == pytest.approx(((a < 0) & (r < 1 - EPS_LOW)).float().mean().item())
    assert st.clip_frac_high.item() == pytest.approx(((a > 0) & (r > 1 + EPS_HIGH)).float().mean().item())
    assert st.clip_frac_low.item() > 0 and st.clip_frac_high.item() > 0  # the test exercises both
    assert st.ratio_mean.item() == pytest.approx(r.mean().item(), rel=1e-6)
    assert st.ratio_min.item() == pytest.approx(r.min().item())
    assert st.ratio_max.item() == pytest.approx(r.max().item())
    assert set(st.as_dict("loss/")) >= {"loss/clip_frac_low", "loss/ratio_max"}
    assert loss.item() == pytest.approx(clipped_token_loss(lp, b, adv, mask).item())


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_microbatch_and_data_parallel_accumulation_equals_full_minibatch(level):
    """Split 12 sequences over 2 'DP ranks' x uneven micro-batches, each call normalised by the
    global count: the summed losses and accumulated gradients equal the one-shot minibatch."""
    lp, b, adv, mask = _batch(B=12, T=10, seed=4)
    lp.requires_grad_(True)
    full = clipped_token_loss(lp, b, adv, mask, level=level)
    (g_full,) = torch.autograd.grad(full, lp)

    norm = mask.sum() if level == "token" else torch.tensor(float(mask.any(1).sum()))
    ranks = [[slice(0, 2), slice(2, 7)], [slice(7, 8), slice(8, 12)]]  # rank -> its micro-batches
    total, grad_sum = 0.0, torch.zeros_like(lp)
    for micro in ranks:
        rank_grad = torch.zeros_like(lp)  # each rank accumulates over its micro-batches
        for sl in micro:
            x = lp.detach()[sl].clone().requires_grad_(True)
            part = clipped_token_loss(x, b[sl], adv[sl], mask[sl], normalizer=norm, level=level)
            part.backward()
            rank_grad[sl] += x.grad
            total += part.item()
        grad_sum += rank_grad  # the DP all-reduce (SUM)
    assert total == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(grad_sum, g_full, rtol=1e-12, atol=1e-15)

    # The naive alternative (each micro-batch normalised by its own count) is NOT the same loss.
    naive = sum(clipped_token_loss(lp[sl], b[sl], adv[sl], mask[sl], level=level).item()
                for micro in ranks for sl in micro)
    assert abs(naive - full.item()) > 1e-3


def test_token_and_sequence_normalisation_differ_only_with_unequal_lengths():
    lp, b, adv, _ = _batch(B=4, T=6, seed=5)
    full = torch.ones(4, 6, dtype=torch.bool)
    tok = clipped_token_loss(lp, b, adv, full, level="token")
    seq = clipped_token_loss(lp, b, adv, full, level="sequence")
    assert tok.item() == pytest.approx(seq.item(), rel=1e-12)  # equal lengths: same objective
    ragged = torch.arange(6)[None, :] < torch.tensor([1, 6, 2, 6])[:, None]
    tok = clipped_token_loss(lp, b, adv, ragged, level="token")
    seq = clipped_token_loss(lp, b, adv, ragged, level="sequence")
    assert abs(tok.item() - seq.item()) > 1e-3
    # Token level: a long sequence's tokens weigh like any other token (gradient per token = 1/N).
    lp2 = torch.zeros(2, 6, dtype=torch.float64, requires_grad=True)
    short_long = torch.arange(6)[None, :] < torch.tensor([1, 6])[:, None]
    ones = torch.ones(2, dtype=torch.float64)
    clipped_token_loss(lp2, torch.zeros(2, 6, dtype=torch.float64), ones, short_long).backward()
    torch.testing.assert_close(lp2.grad[short_long], torch.full((7,), -1 / 7, dtype=torch.float64))
    lp2.grad = None
    clipped_token_loss(lp2, torch.zeros(2, 6, dtype=torch.float64), ones, short_long, level="sequence").backward()
    assert lp2.grad[0, 0].item() == pytest.approx(-1 / 2)  # the lone token of the short answer
    assert lp2.grad[1, 0].item() == pytest.approx(-1 / 12)


def test_bf16_inputs_are_upcast_and_all_masked_call_is_zero():
    lp, b, adv, mask = _batch(dtype=torch.float32, seed=6)
    out = clipped_token_loss(lp.bfloat16(), b.bfloat16(), adv, mask)
    assert out.dtype == torch.float32
    x = lp.clone().requires_grad_(True)
    z = clipped_token_loss(x, b, adv, torch.zeros_like(mask))
    z.backward()
    assert z.item() == 0.0 and (x.grad == 0).all()


def test_truncated_importance_weights_with_proximal_anchor():
    lp, b, adv, mask = _batch(seed=7)
    prox = b + 0.7 * torch.randn(lp.shape, dtype=lp.dtype)  # the trainer's own old logprobs
    cap = 1.5
    got = clipped_token_loss(lp, b, adv, mask, proximal_logprobs=prox, tis_cap=cap)
    w = torch.exp(prox - b).clamp_max(cap)
    terms = token_loss_terms(lp, prox, adv, mask)  # plain loss anchored on the proximal policy
    ref = (terms.loss * w)[mask].sum() / mask.sum()
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    assert (w < torch.exp(prox - b)).any()  # the cap is active somewhere


def test_truncated_ratio_bounds_gradient_weight_without_proximal():
    # A < 0 and a very stale token (r = e^2 >> cap): the unclipped branch would give weight r.
    lp = torch.tensor([[2.0, 0.1]], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, 2, dtype=torch.float64)
    a = torch.tensor([-1.0], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    clipped_token_loss(lp, b, a, mask, tis_cap=2.0).backward()
    torch.testing.assert_close(lp.grad[0], torch.tensor([2.0 / 2, math.exp(0.1) / 2], dtype=torch.float64))
    lp.grad = None
    clipped_token_loss(lp, b, a, mask).backward()
    assert lp.grad[0, 0].item() == pytest.approx(math.exp(2.0) / 2)


def test_bad_inputs_raise_clear_errors():
    lp, b, adv, mask = _batch()
    with pytest.raises(ValueError, match="advantages"):
        clipped_token_loss(lp, b, adv[:-1], mask)
    with pytest.raises(ValueError, match="must match"):
        clipped_token_loss(lp, b[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="normalizer"):
        clipped_token_loss(lp, b, adv, mask, normalizer=0)
    with pytest.raises(ValueError, match="tis_cap"):
        clipped_token_loss(lp, b, adv, mask, tis_cap=0.5)
    with pytest.raises(ValueError, match="level"):
        aggregate(lp, mask, level="batch")


def _limit_reference(a, log_r, eps_low, eps_high, cap=None, band=None):
    """(value, d value / d logp) of one token from the formula, analytically, valid for any log-ratio
    (also where r = e^log_r overflows a float): l = -min(r A, clip(r) A) * w, w = min(1, cap / r)
    (token_tis) or [low <= r <= high] (token_mask), w a constant of the gradient."""
    lo, hi = math.log(1 - eps_low), math.log(1 + eps_high)
    if a == 0:
        return 0.0, 0.0
    clipped = (a > 0 and log_r > hi) or (a < 0 and log_r < lo)
    if band is not None and not math.log(band[0]) <= log_r <= math.log(band[1]):
        return 0.0, 0.0
    if clipped:
        eff = 1 + eps_high if a > 0 else 1 - eps_low  # clip(r) * w -> 0 when w = cap / r -> 0
        w = 1.0 if cap is None or log_r <= math.log(cap) else cap / math.exp(min(log_r, 700.0))
        return -a * eff * w, 0.0
    if cap is not None and log_r > math.log(cap):  # r * (cap / r) = cap, in value and gradient weight
        return -a * cap, -a * cap
    r = math.exp(log_r)
    return -a * r, -a * r


@pytest.mark.parametrize("dtype,big", [(torch.float32, 100.0), (torch.float64, 800.0)])
@pytest.mark.parametrize("corr", [None, ("cap", 2.0), ("band", (0.5, 2.0))])
def test_overflowing_ratio_gives_the_formulas_finite_value_and_gradient(dtype, big, corr):
    """A behaviour logprob far below the trainer's (r = e^big overflows the dtype): where the objective is
    finite (A >= 0: clipped; A < 0 with a weight that cancels r) value and gradient must be too, not nan."""
    from megatron_rl.algo.correction import ISCorrection

    cases = [(1.0, big), (0.0, big), (-1.0, big), (0.7, 0.1), (-0.4, -0.1), (2.0, -big)]
    kw, cap, band = {}, None, None
    if corr is not None and corr[0] == "cap":
        kw, cap = {"tis_cap": corr[1]}, corr[1]
    elif corr is not None:
        kw, band = {"correction": ISCorrection("token_mask", low=corr[1][0], high=corr[1][1])}, corr[1]
    lp = torch.zeros(1, len(cases), dtype=dtype, requires_grad=True)
    behaviour = torch.tensor([[-lr for _, lr in cases]], dtype=dtype)
    adv = torch.tensor([[a for a, _ in cases]], dtype=dtype)
    mask = torch.ones(1, len(cases), dtype=torch.bool)
    loss = clipped_token_loss(lp, behaviour, adv, mask, EPS_LOW, EPS_HIGH, normalizer=1.0, **kw)
    loss.backward()
    unbounded = corr is None  # A < 0 with nothing bounding r: the formula itself is +inf there
    finite = [i for i, (a, lr) in enumerate(cases) if not (unbounded and a < 0 and lr == big)]
    want = {i: _limit_reference(*cases[i], EPS_LOW, EPS_HIGH, cap, band) for i in finite}
    tol = dict(rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-6 if dtype == torch.float32 else 1e-12)
    torch.testing.assert_close(lp.grad[0, finite], torch.tensor([want[i][1] for i in finite], dtype=dtype), **tol)
    if unbounded:
        assert loss.item() == math.inf and lp.grad[0, 2].item() == math.inf  # inf, never nan
    else:
        assert loss.item() == pytest.approx(sum(v for v, _ in want.values()), rel=1e-5)


@pytest.mark.parametrize("a", [1.0, -1.0])
def test_ratio_exactly_on_a_clip_boundary_is_unclipped(a):
    """r = 1 + eps_high (A > 0) or 1 - eps_low (A < 0) exactly (2 and 1/2 are exact in binary): the
    token is not clipped (clip_frac uses strict inequalities) and gets the full gradient -A r / N."""
    eps_low, eps_high = 0.5, 1.0
    r = 2.0 if a > 0 else 0.5
    lp = torch.tensor([[math.log(r), 0.0]], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, st = clipped_token_loss_with_stats(lp, b, torch.tensor([a], dtype=torch.float64), mask, eps_low, eps_high)
    loss.backward()
    assert torch.exp(lp.detach()[0, 0]).item() == r  # the boundary itself, not a rounding of it
    assert lp.grad[0].tolist() == [-a * r / 2, -a * 1.0 / 2]
    assert loss.item() == -a * (r + 1.0) / 2
    assert st.clip_frac_low.item() == 0.0 and st.clip_frac_high.item() == 0.0
