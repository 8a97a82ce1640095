"""Optional KL regularisation towards a reference policy (off by default, as in Magistral).

Goal: a gradient whose expectation is the TRUE gradient of the sequence-level KL
    KL(pi_theta || pi_ref) = E_{y ~ pi_theta}[ log pi_theta(y) - log pi_ref(y) ],
    grad KL = E_{y ~ pi_theta}[ (log pi_theta(y) - log pi_ref(y)) * grad log pi_theta(y) ]
(the extra term E[grad log pi_theta(y)] is 0). Two correct ways are offered:

1. KL in the reward (`kl_mode="reward"`): `kl_penalty_rewards` gives the detached per-sequence
   k1 = sum_t (log pi_theta - log pi_ref); use r_i - kl_coef * k1_i as the reward before the group
   advantages. The policy-gradient (score-function) term of the loss then carries -kl_coef * grad KL.
   `kl_reward_to_go` is the per-token causal version (sum over s >= t), same expectation, less noise,
   for `[B, T]` advantages.
2. The k2 loss at the sequence level (`kl_mode="k2"`): `kl_k2_loss` = mean_i 1/2 (log pi_theta(y_i) -
   log pi_ref(y_i))^2 differentiated directly; its gradient is exactly the sample of grad KL above.

Why differentiating the k1 or k3 ESTIMATE as a loss is wrong (Tang & Munos, "On a few pitfalls in KL
divergence gradient estimation for RL", seeds/003): those estimators are unbiased for the KL VALUE, but
the samples come from pi_theta, and autograd through the estimate ignores that the sampling
distribution moves with theta.
- k1 = log pi_theta - log pi_ref as a loss: grad = grad log pi_theta(y), whose expectation is 0. The
  "KL loss" then only adds zero-mean noise and never pulls towards pi_ref.
- k3 = rho - 1 - log rho with rho = pi_ref / pi_theta (per token) as a loss: grad = (1 - rho) grad log
  pi_theta, whose expectation is -sum_y pi_ref grad log pi_theta = grad KL(pi_ref || pi_theta): the
  gradient of the REVERSE KL, not of the KL being estimated.
- Per-token k2 (sum_t 1/2 (log pi_theta_t - log pi_ref_t)^2) is correct for each token's conditional
  KL but holds the distribution of the earlier tokens fixed: it misses how changing early tokens changes
  the KL of later ones, a partial gradient. Squaring the SEQUENCE log-ratio (what `kl_k2_loss` does)
  couples every token to the whole sequence's log-ratio and gives the full gradient.
All three claims are checked by exact enumeration in tests/unit/test_algo_estimators.py.

These expectations are over on-policy samples (logprobs of the current weights on sequences it
sampled); with stale behaviour samples they hold up to the usual off-policy error, like the PG term.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .loss import Normalizer


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    if logprobs.dim() != 2 or ref_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs, ref_logprobs and mask must all be [B, T]; got "
                         f"{tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)}, {tuple(mask.shape)}")
    m = mask.bool()
    return (logprobs - ref_logprobs.detach()).masked_fill(~m, 0.0)


def sequence_log_ratio(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """`[B]` log pi_theta(y_i) - log pi_ref(y_i) over the unmasked tokens (graph-connected)."""
    return _log_ratio(logprobs, ref_logprobs, mask).sum(dim=1)


def kl_penalty_rewards(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Detached `[B]` per-sequence k1 to subtract (times kl_coef) from the rewards."""
    return sequence_log_ratio(logprobs, ref_logprobs, mask).detach()


def kl_reward_to_go(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Detached `[B, T]` causal KL return sum_{s >= t} (log pi_theta_s - log pi_ref_s), 0 on padding.

    Subtract kl_coef times this from `[B, T]` token advantages: token t's score is only weighted by the
    log-ratios it can influence (same expectation as the sequence total, lower variance).
    """
    lr = _log_ratio(logprobs, ref_logprobs, mask).detach()
    rtg = lr.flip(1).cumsum(1).flip(1)
    return rtg.masked_fill(~mask.bool(), 0.0)


def kl_k2_segment_sum(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, segment_ids: Tensor,
                      n_segments: int | None = None) -> Tensor:
    """sum_i 1/2 (log pi_theta(y_i) - log pi_ref(y_i))^2 over packed rows: flat `[N]` tensors where
    `segment_ids` (int, >= 0) says which sequence each token belongs to (graph-connected to logprobs).
    The same value as `kl_k2_loss(...) * n_sequences` on the unpacked `[B, T]` layout.

    n_segments: max(segment_ids) + 1 when the caller knows it on the host (the packer's count), which
    spares reading the maximum back from the device (a host sync per call); None: read it."""
    if not (logprobs.shape == ref_logprobs.shape == mask.shape == segment_ids.shape) or logprobs.dim() != 1:
        raise ValueError(f"logprobs, ref_logprobs, mask and segment_ids must all be [N]; got "
                         f"{tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)}, {tuple(mask.shape)}, "
                         f"{tuple(segment_ids.shape)}")
    lr = torch.where(mask.bool(), logprobs - ref_logprobs.detach().to(logprobs.dtype), 0.0)
    if n_segments is not None:
        n_seg = n_segments
    else:
        n_seg = int(segment_ids.max()) + 1 if segment_ids.numel() else 0
    seq = lr.new_zeros(n_seg).index_add(0, segment_ids.long(), lr)
    return 0.5 * (seq * seq).sum()


def kl_k2_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
               normalizer: Normalizer = None) -> Tensor:
    """Sequence-level k2 loss: sum_i 1/2 (log pi_theta(y_i) - log pi_ref(y_i))^2 / normalizer.

    normalizer: number of sequences in the whole minibatch (all micro-batches and DP ranks), so that
    accumulation gives the minibatch mean; None -> sequences with >= 1 unmasked token in this call.
    Its gradient's expectation is grad KL(pi_theta || pi_ref) per sequence. Scale by kl_coef and add it
    to the policy loss; note the policy loss is per token, so kl_coef trades a per-sequence KL
    against a per-token surrogate.
    """
    seq = sequence_log_ratio(logprobs, ref_logprobs, mask)
    total = 0.5 * (seq * seq).sum()
    if normalizer is None:
        return total / mask.bool().any(dim=1).sum().clamp_min(1).to(total.dtype)
    if isinstance(normalizer, Tensor):
        return total / normalizer.to(device=total.device, dtype=total.dtype).reshape(())
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return total / float(normalizer)
