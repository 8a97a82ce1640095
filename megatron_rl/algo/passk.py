"""Advantage estimator for pass@k (max@k) training, an option beyond Magistral's recipe.

Inference-time objectives (seeds: "optimizing for inference time objectives ... pass@k"): instead of the
expected reward of one sample, maximise J_k = E[max(f(y_1), ..., f(y_k))] over k i.i.d. samples; for
0/1 rewards this is pass@k = 1 - (1 - p)^k. Its gradient is
    grad J_k = k * E[ max(f(y_1..y_k)) * grad log pi(y_1) ].
From a group of n >= k samples we use every k-subset (a U-statistic). Sample i receives
    A_i = k * ( mean_{T subset of others, |T| = k-1} max(f_i, max T)  -  b_i ),
and (1/n) sum_i A_i grad log pi(y_i) is an unbiased estimate of grad J_k. The baseline b_i never looks at
y_i, so it adds no bias: b_i = mean over k-subsets S of the others of max S when n > k (leave-one-out
estimate of J_k itself), else (n == k) the mean over (k-1)-subsets of the others of max T, so that A_i is
k times sample i's marginal contribution to the max.
When n > k the A_i of a group sum to exactly 0 (both parts sum to n times the U-statistic of J_k).
For k = 1, A_i = f_i - mean_{j != i} f_j = n / (n - 1) * (f_i - mean_group f): plain group centring.

Subset means use order statistics: if o_(1) <= ... <= o_(m) are the m = n - 1 other rewards, a random
j-subset has its maximum at o_(l) with probability C(l-1, j-1) / C(m, j).
The output feeds the same pipeline as `group_advantages` (minibatch normalisation rescales it anyway).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def _max_of_subset_weights(m: int, j: int, dtype: torch.dtype, device) -> Tensor:
    """P(max of a uniformly random j-subset of m sorted values is the l-th smallest), l = 1..m."""
    denom = math.comb(m, j)
    return torch.tensor([math.comb(l - 1, j - 1) / denom for l in range(1, m + 1)], dtype=dtype, device=device)


def pass_at_k_advantages(rewards: Tensor, k: int) -> Tensor:
    """`[n_groups, n]` rewards (0/1 for pass@k, any real for max@k) -> `[n_groups, n]` advantages.

    Unbiased: E[(1/n) sum_i A_i grad log pi(y_i)] = grad E[max of k samples]. Needs 1 <= k <= n.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, n], got shape {tuple(rewards.shape)}")
    n = rewards.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= group size, got k={k}, n={n}")
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    if n == 1:  # k = 1 and no other sample to build a baseline from: REINFORCE with A = f
        return rewards.to(out_dtype).clone()
    f = rewards.to(torch.float64)  # the combinatorial weights want fp64
    # A_i is shift-invariant (max commutes with a shift, both weight sets sum to 1): measured from the group
    # minimum, a constant group gives exactly 0 instead of the rounding of sum(weights) - 1 times the reward
    f = f - f.min(dim=1, keepdim=True).values
    m = n - 1
    w_term = None if k == 1 else _max_of_subset_weights(m, k - 1, f.dtype, f.device)
    w_base = _max_of_subset_weights(m, k if m >= k else k - 1, f.dtype, f.device)
    out = torch.empty_like(f)
    for i in range(n):
        others = torch.cat([f[:, :i], f[:, i + 1:]], dim=1).sort(dim=1).values  # [n_groups, m]
        fi = f[:, i:i + 1]
        term = fi[:, 0] if w_term is None else (torch.maximum(fi, others) * w_term).sum(dim=1)
        base = (others * w_base).sum(dim=1)
        out[:, i] = k * (term - base)
    return out.to(out_dtype)
