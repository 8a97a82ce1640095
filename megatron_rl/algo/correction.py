"""Importance-sampling corrections of the trainer/generator mismatch (`algo.is_correction`).

The behaviour logprobs come from the generator, whose numerics (kernels, precision, batching) differ
from the trainer's even at the same weights, and which may be some versions behind. The importance
factor of token t is rho_t = pi_anchor(y_t) / pi_behaviour(y_t), anchor = the trainer's policy at the
start of the update (`proximal_logprobs`, `algo.proximal: trainer`). A correction replaces rho_t by a
bounded factor c_t before it multiplies the token's loss:

- `token_tis`: c_t = min(rho_t, cap) (truncated IS; cap None = rho_t itself, no correction).
- `token_mask`: c_t = rho_t if low <= rho_t <= high, else 0: tokens outside the band leave the loss
  (their terms are zeroed; the token-count normaliser is unchanged, so every kept token weighs the same
  whatever is masked).
- `sequence_tis`: c_t = min(exp(mean_{s in seq(t)} log rho_s), cap) for every token of a sequence: the
  geometric mean of the sequence's token ratios, truncated (cap None = not truncated).

Without `proximal_logprobs` the PPO ratio r_t = pi_theta / pi_behaviour already carries rho_t (it equals
rho_t on the first minibatch of an update, before any step): the loss weight is then c_t / r_t with the
ratio detached, so the gradient factor becomes c_t: `token_tis` gives min(1, cap / r_t), `token_mask`
the 0/1 band indicator of r_t. `sequence_tis` needs the proximal logprobs (a geometric mean of ratios
that move within the update is not the mismatch).
All factors are detached (constants of the gradient) and 0 on masked positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Kind = Literal["token_tis", "token_mask", "sequence_tis"]
KINDS: tuple[str, ...] = ("token_tis", "token_mask", "sequence_tis")


@dataclass(frozen=True)
class ISCorrection:
    """Which correction, with its cap (token_tis, sequence_tis) or band (token_mask)."""

    kind: Kind = "token_tis"
    cap: float | None = None
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"is_correction must be one of {KINDS}, got {self.kind!r}")
        if self.cap is not None and self.cap < 1.0:
            raise ValueError(f"tis_cap must be >= 1, got {self.cap}")
        if not 0.0 < self.low <= 1.0 <= self.high:
            raise ValueError(f"the mask band needs 0 < low <= 1 <= high, got [{self.low}, {self.high}]")

    @property
    def active(self) -> bool:
        """False for token_tis without a cap: the factor is rho_t itself (plain importance sampling)."""
        return not (self.kind == "token_tis" and self.cap is None)


def is_correction(algo) -> ISCorrection:
    """The correction an `AlgoConfig` asks for (is_correction, tis_cap, mask_ratio_low/high)."""
    if algo.is_correction == "token_mask":
        return ISCorrection("token_mask", low=algo.mask_ratio_low, high=algo.mask_ratio_high)
    return ISCorrection(algo.is_correction, cap=algo.tis_cap)


def _in_band(log_rho: Tensor, corr: ISCorrection) -> Tensor:
    return (log_rho >= math.log(corr.low)) & (log_rho <= math.log(corr.high))


def segment_mean(values: Tensor, mask: Tensor, segment_ids: Tensor | None) -> Tensor:
    """Per-position mean of `values` over the unmasked positions of its sequence, `[B, T]`.
    segment_ids `[B, T]` tells the sequences of a packed row apart; None: each row is one sequence."""
    v = torch.where(mask, values, 0.0)
    if segment_ids is None:
        mean = v.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1).to(v.dtype)
        return mean.expand_as(v)
    b = v.shape[0]
    # one id space over all rows: a sequence never spans two rows
    seg = segment_ids.to(torch.int64)
    width = int(seg.max()) + 1 if seg.numel() else 1
    flat = (seg + torch.arange(b, device=seg.device)[:, None] * width).reshape(-1)
    sums = torch.zeros(b * width, dtype=v.dtype, device=v.device).index_add_(0, flat, v.reshape(-1))
    counts = torch.zeros(b * width, dtype=v.dtype, device=v.device).index_add_(0, flat, mask.reshape(-1).to(v.dtype))
    return (sums / counts.clamp_min(1))[flat].view_as(v)


def anchored_factor(log_rho: Tensor, mask: Tensor, corr: ISCorrection,
                    segment_ids: Tensor | None = None) -> Tensor:
    """c_t from log rho_t = proximal - behaviour (detached, `[B, T]`, 0 where masked)."""
    log_rho = torch.where(mask, log_rho.detach(), 0.0)
    if corr.kind == "sequence_tis":
        log_rho = segment_mean(log_rho, mask, segment_ids)
    factor = torch.exp(log_rho)
    if corr.kind == "token_mask":
        factor = torch.where(_in_band(log_rho, corr), factor, 0.0)
    elif corr.cap is not None:
        factor = factor.clamp_max(corr.cap)
    return torch.where(mask, factor, 0.0)


def current_ratio_weight(ratio: Tensor, mask: Tensor, corr: ISCorrection) -> Tensor:
    """Loss weight c_t / r_t when the PPO ratio r_t is anchored on the behaviour (no proximal pass)."""
    r = ratio.detach()
    if corr.kind == "sequence_tis":
        raise ValueError("is_correction: sequence_tis needs the proximal logprobs (algo.proximal: trainer)")
    if corr.kind == "token_mask":
        weight = _in_band(torch.log(r), corr).to(r.dtype)
    elif corr.cap is not None:
        weight = (corr.cap / r).clamp_max(1.0)
    else:
        weight = torch.ones_like(r)
    return torch.where(mask, weight, 0.0)
