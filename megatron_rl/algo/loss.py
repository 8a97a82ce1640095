"""Magistral's clipped surrogate, token-normalised (the reference implementation).

Per completion token t of sequence i, with r_t = exp(logp_theta - logp_behaviour):

    l_t = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)
    loss = sum_{i,t} mask * l_t / normalizer

`normalizer` is the number of unmasked tokens of the WHOLE optimizer minibatch (token-level
normalisation, as in Magistral/DAPO: every token weighs the same, long answers are not diluted into a
per-sequence mean). When a minibatch is split into micro-batches (gradient accumulation) and over
data-parallel ranks, pass the same global `normalizer` to every call: the sum of the micro-batch losses
(and of their gradients after a DP all-reduce that SUMS; multiply by dp_size if it averages) is then
exactly the full-minibatch loss.
With `normalizer=None` it is `mask.sum()` of this call, which is right only for a single call per
minibatch. `level="sequence"` gives the original GRPO mean of per-sequence means instead; then the
normaliser counts sequences.

`logp_behaviour` is what the generator reported when it sampled each token; a sequence generated
across in-flight weight updates mixes policy versions and the per-token ratio stays exact.

Options beyond the recipe (off by default):
- `proximal_logprobs` + `tis_cap`: decoupled objective for stale behaviour logprobs. The ratio is
  anchored on the trainer's own logprobs of the pre-update weights (`proximal`), and the behaviour
  mismatch enters as a per-token importance weight w = exp(proximal - behaviour), detached and
  truncated at `tis_cap` (truncated importance sampling, as in IMPALA/V-trace).
- `tis_cap` without `proximal_logprobs`: the importance weight pi_theta / pi_behaviour that
  multiplies each token's score-function gradient is truncated at `tis_cap` (the token's term is
  scaled by the detached factor min(1, cap / r_t), so its gradient is -min(r_t, cap) A grad logp).
  This bounds the update from very stale tokens with negative advantage, the one branch the PPO clip
  leaves unbounded.
- `correction` (`algo.correction.ISCorrection`): the general form of the two above, with masked IS
  (`token_mask`) and sequence-level IS (`sequence_tis`, per-sequence from `segment_ids`); `tis_cap`
  alone is `ISCorrection("token_tis", tis_cap)`. Pass one or the other.
- `entropy` + `entropy_coef`: the entropy bonus l_t -= entropy_coef * H_t, with H_t the entropy of
  pi_theta over the vocabulary at token t (graph-connected, e.g. `train.logprobs.token_entropy`), so
  minimising the loss raises the entropy. It is normalised like the surrogate and not importance
  weighted (a regulariser of the current policy). Magistral tried it and kept clip-higher instead
  (`algo.entropy_coef`, 0 = off; docs/experiments.md).

Everything is computed in at least float32 (bf16 inputs are upcast, float64 is kept); masked positions never contribute, even
if they hold inf/nan (padding). A ratio that overflows the dtype where the objective is finite (A >= 0, or a
bounded correction) gives the formula's limit, not nan (`_loss_log_ratio`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .correction import ISCorrection, anchored_factor, current_ratio_weight

Level = Literal["token", "sequence"]
Normalizer = float | int | Tensor | None


@dataclass
class LossStats:
    """Detached per-call statistics over unmasked tokens (0-dim float32 tensors, no host sync).

    clip_frac_low: tokens with A < 0 and r < 1 - eps_low (clipped: no gradient).
    clip_frac_high: tokens with A > 0 and r > 1 + eps_high (clipped: no gradient).
    For data-parallel logging weight each rank's fractions/mean by `n_tokens`; min/max reduce directly.
    """

    n_tokens: Tensor
    clip_frac_low: Tensor
    clip_frac_high: Tensor
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor
    is_weight_mean: Tensor  # mean truncated importance weight (1 when the option is off)
    is_masked_frac: Tensor  # tokens masked out of the loss by is_correction token_mask

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """Python floats for logging (one host sync)."""
        return {prefix + k: float(v) for k, v in vars(self).items()}


@dataclass
class TokenLossTerms:
    """Per-token pieces of the loss, `[B, T]` float32; masked positions hold 0 / False."""

    loss: Tensor  # l_t (graph-connected), before normalisation
    ratio: Tensor  # r_t, detached
    clipped_low: Tensor  # bool, see LossStats
    clipped_high: Tensor  # bool
    is_weight: Tensor  # detached importance weight multiplying l_t (1 when the option is off)
    mask: Tensor  # bool
    is_masked: Tensor | None = None  # bool: tokens token_mask drops (None for other corrections)

    def stats(self) -> LossStats:
        m = self.mask
        n = m.sum()
        r = self.ratio
        denom = n.clamp_min(1).to(r.dtype)
        big = torch.finfo(r.dtype).max
        any_tok = n > 0
        zero = torch.zeros((), dtype=r.dtype, device=r.device)
        return LossStats(
            n_tokens=n.to(r.dtype),
            clip_frac_low=self.clipped_low.sum() / denom,
            clip_frac_high=self.clipped_high.sum() / denom,
            ratio_mean=(r * m).sum() / denom,
            ratio_min=torch.where(any_tok, torch.where(m, r, big).min(), zero),
            ratio_max=torch.where(any_tok, torch.where(m, r, -big).max(), zero),
            is_weight_mean=(self.is_weight * m).sum() / denom,
            is_masked_frac=(self.is_masked.sum() / denom if self.is_masked is not None else zero),
        )


def _check_inputs(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                  eps_low: float, eps_high: float) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if behaviour_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(f"behaviour_logprobs {tuple(behaviour_logprobs.shape)} and mask "
                         f"{tuple(mask.shape)} must match logprobs {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(logprobs.shape)}, "
                         f"got {tuple(advantages.shape)}")
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")


def token_loss_terms(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                     eps_low: float = 0.2, eps_high: float = 0.28, *,
                     proximal_logprobs: Tensor | None = None,
                     tis_cap: float | None = None, correction: ISCorrection | None = None,
                     segment_ids: Tensor | None = None, entropy: Tensor | None = None,
                     entropy_coef: float = 0.0) -> TokenLossTerms:
    """Per-token clipped-surrogate terms and clip/ratio bookkeeping (see the module docstring).
    segment_ids `[B, T]`: sequences of a packed row (sequence_tis); None: one sequence per row.
    entropy `[B, T]`: per-token policy entropy, needed when entropy_coef != 0 (the bonus)."""
    _check_inputs(logprobs, behaviour_logprobs, advantages, mask, eps_low, eps_high)
    if entropy_coef != 0.0 and (entropy is None or entropy.shape != logprobs.shape):
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy of shape {tuple(logprobs.shape)}, got "
                         f"{None if entropy is None else tuple(entropy.shape)}")
    if correction is not None and tis_cap is not None:
        raise ValueError("pass tis_cap or correction, not both (the correction carries its cap)")
    corr = correction if correction is not None else ISCorrection("token_tis", tis_cap)
    m = mask.bool()
    f32 = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 -> fp32; fp64 stays (gradcheck)
    lp = logprobs.to(f32)
    behav = behaviour_logprobs.to(f32).detach()
    anchor = behav if proximal_logprobs is None else proximal_logprobs.to(f32).detach()
    adv = advantages.to(f32).detach()
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand_as(lp)

    # where() instead of a product with the mask: padding may hold -inf/nan and must not leak (0*inf).
    log_ratio = torch.where(m, lp - anchor, 0.0)
    loss_log_ratio = _loss_log_ratio(log_ratio, adv, corr if proximal_logprobs is None else None)
    ratio = torch.exp(loss_log_ratio)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)

    if proximal_logprobs is not None:  # the mismatch factor rho = exp(proximal - behaviour), corrected
        weight = anchored_factor(anchor - behav, m, corr, segment_ids)
    else:  # the ratio carries rho: a stop-gradient factor turns its gradient weight r into c
        weight = current_ratio_weight(ratio, m, corr)
    per_token = per_token * weight
    if entropy_coef != 0.0:
        per_token = per_token + entropy_bonus_terms(entropy.to(f32), entropy_coef)
    per_token = torch.where(m, per_token, 0.0)

    r = log_ratio.detach().exp()  # the true ratio (inf if it overflows) for the statistics
    return TokenLossTerms(
        loss=per_token,
        ratio=torch.where(m, r, 0.0),
        clipped_low=m & (adv < 0) & (r < 1.0 - eps_low),
        clipped_high=m & (adv > 0) & (r > 1.0 + eps_high),
        is_weight=torch.where(m, weight, 0.0),
        mask=m,
        is_masked=m & (weight == 0) if corr.kind == "token_mask" else None,
    )


def _loss_log_ratio(log_ratio: Tensor, adv: Tensor, corr: ISCorrection | None) -> Tensor:
    """The log-ratio the surrogate exponentiates: the true one up to half the dtype's exp range (44 nats in
    float32), so that r never overflows where the objective is finite (r = inf gives inf * 0 = nan in the
    value or, through exp's backward, in the gradient: e.g. a behaviour logprob of -100 in float32).
    - A >= 0 only sees min(r, 1 + eps_high): beyond the limit the token is clipped anyway (same value, zero
      gradient), so the exponent is simply capped.
    - A < 0 under a correction of the current ratio that bounds its weight (`corr`: token_tis with a cap,
      token_mask): the weight c / r cancels r, so a straight-through cap (value capped, gradient 1) keeps
      value and gradient (-A min(r, cap) d logp, resp. 0) finite and as the formula gives them.
    - A < 0 otherwise is the unbounded branch of the clip: r overflows as the formula does.
    """
    pos = log_ratio.clamp_max(math.log(torch.finfo(log_ratio.dtype).max) / 2)
    if corr is None or not (corr.kind == "token_mask" or corr.cap is not None):
        return torch.where(adv >= 0, pos, log_ratio)
    return torch.where(adv >= 0, pos, log_ratio - (log_ratio - pos).detach())


def entropy_bonus_terms(entropy: Tensor, entropy_coef: float) -> Tensor:
    """Per-token loss terms of the entropy bonus: -entropy_coef * H_t (maximising the entropy).
    Unmasked positions only count after `aggregate` (or a masked sum)."""
    if entropy_coef < 0:
        raise ValueError(f"entropy_coef must be >= 0 (a bonus), got {entropy_coef}")
    return -entropy_coef * entropy


def aggregate(per_token: Tensor, mask: Tensor, normalizer: Normalizer = None,
              level: Level = "token") -> Tensor:
    """Reduce per-token terms `[B, T]` to the scalar loss.

    level="token": sum over all unmasked tokens / normalizer (default: mask.sum()).
    level="sequence": sum over sequences of (per-sequence token mean) / normalizer (default: number
    of sequences with at least one unmasked token). `normalizer` must be > 0; pass the count over the
    whole minibatch (all micro-batches and DP ranks) when accumulating.
    """
    m = mask.bool()
    if level == "token":
        total = torch.where(m, per_token, 0.0).sum()
        count = m.sum()
    elif level == "sequence":
        lengths = m.sum(dim=1)
        seq_sum = torch.where(m, per_token, 0.0).sum(dim=1)
        total = (seq_sum / lengths.clamp_min(1)).sum()
        count = (lengths > 0).sum()
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if normalizer is None:
        # An all-masked call contributes 0 (with a graph) rather than nan.
        return total / count.clamp_min(1).to(total.dtype)
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
        return total / normalizer.to(device=total.device, dtype=total.dtype).reshape(())
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return total / float(normalizer)


def clipped_token_loss(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                       eps_low: float = 0.2, eps_high: float = 0.28, *,
                       normalizer: Normalizer = None, level: Level = "token",
                       proximal_logprobs: Tensor | None = None,
                       tis_cap: float | None = None, correction: ISCorrection | None = None,
                       segment_ids: Tensor | None = None, entropy: Tensor | None = None,
                       entropy_coef: float = 0.0) -> Tensor:
    """Scalar token-normalised clipped surrogate loss (Magistral's GRPO objective, negated).

    logprobs: `[B, T]` log pi_theta of the sampled tokens (requires grad).
    behaviour_logprobs: `[B, T]` generator logprobs of the same tokens.
    advantages: `[B]` (one per sequence) or `[B, T]`; treated as constants.
    mask: `[B, T]` bool/0-1, True on completion tokens that count.
    normalizer: total unmasked tokens of the whole minibatch across micro-batches and DP ranks
        (float, int or 0-dim tensor); None -> mask.sum() of this call.
    entropy, entropy_coef: the entropy bonus (module docstring); entropy `[B, T]` graph-connected.
    """
    terms = token_loss_terms(logprobs, behaviour_logprobs, advantages, mask, eps_low, eps_high,
                             proximal_logprobs=proximal_logprobs, tis_cap=tis_cap,
                             correction=correction, segment_ids=segment_ids,
                             entropy=entropy, entropy_coef=entropy_coef)
    return aggregate(terms.loss, terms.mask, normalizer, level)


def clipped_token_loss_with_stats(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                                  mask: Tensor, eps_low: float = 0.2, eps_high: float = 0.28, *,
                                  normalizer: Normalizer = None, level: Level = "token",
                                  proximal_logprobs: Tensor | None = None,
                                  tis_cap: float | None = None, correction: ISCorrection | None = None,
                                  segment_ids: Tensor | None = None, entropy: Tensor | None = None,
                                  entropy_coef: float = 0.0) -> tuple[Tensor, LossStats]:
    """`clipped_token_loss` plus its LossStats, computed from the same per-token terms."""
    terms = token_loss_terms(logprobs, behaviour_logprobs, advantages, mask, eps_low, eps_high,
                             proximal_logprobs=proximal_logprobs, tis_cap=tis_cap,
                             correction=correction, segment_ids=segment_ids,
                             entropy=entropy, entropy_coef=entropy_coef)
    return aggregate(terms.loss, terms.mask, normalizer, level), terms.stats()
