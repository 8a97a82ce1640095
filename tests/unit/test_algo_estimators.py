"""KL and pass@k gradient estimators against exact gradients on a small tabular policy.

The policy generates sequences of length 3 over 3 tokens (27 sequences), one softmax per prefix, so
every expectation is a finite sum: the exact objective is differentiated by autograd, and the mean of
each Monte-Carlo estimator is computed exactly by enumerating the samples it could draw.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_rl.algo.advantages import group_advantages
from megatron_rl.algo.kl import kl_k2_loss, kl_penalty_rewards, kl_reward_to_go
from megatron_rl.algo.loss import clipped_token_loss
from megatron_rl.algo.passk import pass_at_k_advantages

V, L = 3, 3
SEQS = torch.tensor(list(itertools.product(range(V), repeat=L)))  # [27, 3]
# Context index of each position: root, then one per prefix of length 1 and 2 (13 contexts).
CTX = torch.stack([torch.zeros(len(SEQS), dtype=torch.long), 1 + SEQS[:, 0], 4 + 3 * SEQS[:, 0] + SEQS[:, 1]], 1)
ONES = torch.ones(len(SEQS), L, dtype=torch.bool)


def token_logprobs(theta):
    """[27, 3] log pi(y_t | y_<t) of every sequence under tabular logits theta [13, V]."""
    return torch.log_softmax(theta, -1)[CTX, SEQS]


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(13, V, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.randn(13, V, generator=g, dtype=torch.float64)
    return theta, ref


def _grad(scalar, theta):
    (g,) = torch.autograd.grad(scalar, theta, retain_graph=True)
    return g


def exact_kl_grad(theta, ref):
    lp = token_logprobs(theta).sum(1)
    return _grad((lp.exp() * (lp - token_logprobs(ref).sum(1))).sum(), theta)


# ----------------------------------------------------------------------------------------- KL

def test_kl_in_reward_through_the_policy_loss_gives_the_true_kl_gradient():
    theta, ref = _params(0)
    tok = token_logprobs(theta)
    ref_tok = token_logprobs(ref)
    prob = tok.sum(1).exp().detach()
    want = exact_kl_grad(theta, ref)
    assert want.norm() > 0.1
    # The sequence penalty enters as (minus) an advantage; E over y ~ pi is the prob-weighted sum,
    # with normalizer=1 so the loss is the plain sum over the enumerated batch.
    k1 = kl_penalty_rewards(tok, ref_tok, ONES)
    loss = clipped_token_loss(tok, tok.detach(), -prob * k1, ONES, normalizer=1.0)
    torch.testing.assert_close(_grad(loss, theta), want, rtol=1e-10, atol=1e-12)
    # Causal per-token version: same expectation.
    rtg = kl_reward_to_go(tok, ref_tok, ONES)
    loss = clipped_token_loss(tok, tok.detach(), -prob[:, None] * rtg, ONES, normalizer=1.0)
    torch.testing.assert_close(_grad(loss, theta), want, rtol=1e-10, atol=1e-12)


def test_sequence_k2_loss_gradient_is_the_true_kl_gradient():
    theta, ref = _params(1)
    tok, ref_tok = token_logprobs(theta), token_logprobs(ref)
    prob = tok.sum(1).exp().detach()
    est = sum(prob[i] * kl_k2_loss(tok[i:i + 1], ref_tok[i:i + 1], ONES[i:i + 1]) for i in range(len(SEQS)))
    torch.testing.assert_close(_grad(est, theta), exact_kl_grad(theta, ref), rtol=1e-10, atol=1e-12)


def test_differentiating_k1_k3_or_per_token_k2_as_a_loss_is_wrong():
    theta, ref = _params(2)
    tok, ref_tok = token_logprobs(theta), token_logprobs(ref)
    prob = tok.sum(1).exp().detach()
    want = exact_kl_grad(theta, ref)
    log_ratio = tok - ref_tok
    k1 = (prob[:, None] * log_ratio).sum()
    k3 = (prob[:, None] * (torch.exp(-log_ratio) - 1 + log_ratio)).sum()
    k2_tok = (prob[:, None] * 0.5 * log_ratio ** 2).sum()
    g1 = _grad(k1, theta)
    assert g1.abs().max() < 1e-12  # E[grad log pi] = 0: no pull towards pi_ref at all
    for wrong in (_grad(k3, theta), _grad(k2_tok, theta)):
        assert (wrong - want).norm() > 0.05 * want.norm()
    # The k3 loss is the gradient of the REVERSE KL: check on the first token alone (one context).
    p0 = torch.softmax(theta[0], -1)
    q0 = torch.softmax(ref[0], -1)
    est = (p0.detach() * (q0 / p0 - 1 - torch.log(q0 / p0))).sum()
    reverse = (q0 * (torch.log(q0) - torch.log(p0))).sum()
    torch.testing.assert_close(_grad(est, theta), _grad(reverse, theta), rtol=1e-10, atol=1e-12)


def test_monte_carlo_kl_in_reward_estimator_mean_is_within_sampling_error():
    theta, ref = _params(3)
    tok, ref_tok = token_logprobs(theta), token_logprobs(ref)
    seq_lp = tok.sum(1)
    # Per-sequence estimator k1(y) grad log pi(y), as rows of a Jacobian [27, 13*V].
    k1 = kl_penalty_rewards(tok, ref_tok, ONES)
    jac = torch.stack([_grad(seq_lp[i], theta).flatten() for i in range(len(SEQS))])
    per_seq = k1[:, None] * jac
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(seq_lp.exp().detach(), 20000, replacement=True, generator=g)
    samples = per_seq[draws]
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(len(draws))
    want = exact_kl_grad(theta, ref).flatten()
    assert ((mean - want).abs() <= 5 * se + 1e-9).all()


# ----------------------------------------------------------------------------------------- pass@k

def _subset_reference(rewards, k):
    """pass@k advantages from explicit subsets (itertools), for one group."""
    n = len(rewards)
    out = []
    for i in range(n):
        others = [rewards[j] for j in range(n) if j != i]
        term = sum(max([rewards[i], *t]) for t in itertools.combinations(others, k - 1)) / math.comb(n - 1, k - 1)
        kb = k if n - 1 >= k else k - 1
        base = sum(max(s) for s in itertools.combinations(others, kb)) / math.comb(n - 1, kb) if kb else 0.0
        out.append(k * (term - base))
    return out


@pytest.mark.parametrize("n,k", [(5, 1), (5, 2), (5, 3), (5, 5), (2, 2)])
def test_pass_at_k_matches_explicit_subset_enumeration(n, k):
    g = torch.Generator().manual_seed(n * 10 + k)
    rewards = torch.rand(4, n, generator=g, dtype=torch.float64).round(decimals=1)
    got = pass_at_k_advantages(rewards, k)
    want = torch.tensor([_subset_reference(r.tolist(), k) for r in rewards], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if n > k:  # with the leave-one-out J_k baseline the advantages sum to 0 in each group
        torch.testing.assert_close(got.sum(1), torch.zeros(4, dtype=torch.float64))


def test_pass_at_1_is_group_centring_up_to_scale():
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.1], [0.3, 0.3, 0.9, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(pass_at_k_advantages(rewards, 1), 4 / 3 * group_advantages(rewards))


@pytest.mark.parametrize("n,k,binary", [(3, 2, True), (3, 2, False), (2, 2, True), (3, 3, False), (3, 1, True)])
def test_pass_at_k_estimator_mean_equals_exact_gradient(n, k, binary):
    theta, _ = _params(4)
    tok = token_logprobs(theta)
    seq_lp = tok.sum(1)
    prob = seq_lp.exp()
    # Rewards: 0/1 (pass@k) or graded (max@k), a fixed function of the sequence.
    f = ((SEQS == 2).sum(1) >= 2).double() if binary else (SEQS.sum(1).double() / 6).round(decimals=1)
    # Exact J_k = E[max of k i.i.d. samples], enumerating all k-tuples.
    tuples_k = torch.tensor(list(itertools.product(range(len(SEQS)), repeat=k)))
    j_k = (prob[tuples_k].prod(1) * f[tuples_k].max(1).values).sum()
    if binary:
        p = (prob * f).sum()
        torch.testing.assert_close(j_k, 1 - (1 - p) ** k)
    want = _grad(j_k, theta)
    assert want.norm() > 1e-3
    # Exact mean of the estimator: every group of n samples, weighted by its probability; the
    # advantages go through the real loss at ratio 1 (on-policy), one row per sample.
    groups = torch.tensor(list(itertools.product(range(len(SEQS)), repeat=n)))  # [27^n, n]
    adv = pass_at_k_advantages(f[groups], k)  # [27^n, n]
    weight = prob[groups].prod(1).detach()[:, None] / n
    rows = groups.flatten()
    lp_rows = tok[rows]
    loss = clipped_token_loss(lp_rows, lp_rows.detach(), (weight * adv).flatten(),
                              torch.ones_like(lp_rows, dtype=torch.bool), normalizer=1.0)
    # Minimising the loss ascends J_k: its gradient is -grad J_k.
    torch.testing.assert_close(_grad(loss, theta), -want, rtol=1e-9, atol=1e-12)


def test_pass_at_k_rejects_bad_k():
    with pytest.raises(ValueError, match="1 <= k"):
        pass_at_k_advantages(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="n_groups"):
        pass_at_k_advantages(torch.zeros(3), 1)


def _binary_closed_form(n, c, k, correct):
    """A_i for 0/1 rewards from the unbiased pass@j estimator 1 - C(m - c', j) / C(m, j) over the
    m = n - 1 others (c' of them correct), exact rationals: k (P(max(f_i, k-1 others) = 1) - baseline)."""
    from fractions import Fraction

    m, c_other = n - 1, c - (1 if correct else 0)

    def pass_at(j):
        return 1 - Fraction(math.comb(m - c_other, j), math.comb(m, j)) if j else Fraction(0)

    term = Fraction(1) if correct else pass_at(k - 1)
    return k * (term - pass_at(k if m >= k else k - 1))


@pytest.mark.parametrize("n,k", [(1, 1), (4, 1), (4, 4), (6, 3), (200, 1), (200, 50), (200, 200), (512, 8)])
def test_binary_pass_at_k_matches_the_unbiased_estimator_closed_form_for_every_c(n, k):
    cs = range(n + 1) if n <= 8 else (0, 1, 2, n // 2, n - 2, n - 1, n)
    for c in cs:
        rewards = torch.tensor([[1.0] * c + [0.0] * (n - c)], dtype=torch.float64)
        got = pass_at_k_advantages(rewards, k)[0]
        if n == 1:  # no other sample: REINFORCE with A = f
            assert got.tolist() == [float(c)]
            continue
        want = [float(_binary_closed_form(n, c, k, i < c)) for i in range(n)]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        if c in (0, n):
            assert (got == 0).all()  # nothing to learn from an all-equal group
