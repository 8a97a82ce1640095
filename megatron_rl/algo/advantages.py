"""Advantages: group centring, the non-diverse-group filter, and minibatch normalisation.

Magistral: for a prompt with G completions and rewards r_i, A_i = r_i - mean_group(r) (no division by
the group std; `group_advantages(..., std=True)` gives the GRPO ablation). Groups whose rewards are all
equal carry no signal (A = 0 everywhere) and are dropped before batching (`filter_non_diverse`).
Inside each optimizer minibatch the advantages are then standardised: A_norm = (A - mean) / std.

Minibatch weighting (decided here, configurable): `token` (default) weighs each sequence by its number
of loss tokens, so mean/std are those of the per-token advantages the token-normalised loss actually
sums; the loss-weighted mean of A_norm is then exactly 0, i.e. the normalised advantages are centred
with respect to the loss they feed. `sequence` weighs every sequence equally (std of the per-sequence
advantages). They coincide when all completions have the same length and differ when advantage
correlates with length (e.g. long wrong answers), which is the usual case in reasoning RL.

The std is the population std (divide by the total weight), so a minibatch of one sequence, or one
whose advantages are all equal, normalises to exactly 0 instead of nan/inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

NormMode = Literal["minibatch", "group", "none"]
Weighting = Literal["token", "sequence"]


def group_advantages(rewards: Tensor, std: bool = False, eps: float = 1e-6) -> Tensor:
    """`[n_groups, G]` rewards -> `[n_groups, G]` advantages r - mean_group(r) (float32 or wider).

    std=True divides by the (unbiased) group std + eps, the GRPO ablation; a constant group stays 0.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    # measured from the group minimum (the result is shift-invariant): a constant group is exactly 0, not
    # the rounding error of its mean (which the std ablation would blow up to O(1e-2) in float32)
    r = r - r.min(dim=1, keepdim=True).values
    adv = r - r.mean(dim=1, keepdim=True)
    if std:
        if r.shape[1] < 2:
            raise ValueError("group std needs G >= 2")
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv


@dataclass
class GroupFilter:
    """Which groups carry signal. `keep` is a bool `[n_groups]`; `n_dropped` a Python int."""

    keep: Tensor
    n_dropped: int

    @property
    def n_kept(self) -> int:
        return int(self.keep.numel()) - self.n_dropped


def filter_non_diverse(rewards: Tensor, atol: float = 1e-6) -> GroupFilter:
    """Mark groups whose rewards are all equal (max - min <= atol) for dropping.

    The tolerance absorbs float noise of composed rewards (0.1 + 0.9 vs 1.0); with atol=0 equality
    is exact.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    if rewards.shape[1] == 0:
        keep = torch.zeros(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    else:
        spread = rewards.max(dim=1).values - rewards.min(dim=1).values
        keep = spread > atol
    return GroupFilter(keep=keep, n_dropped=int((~keep).sum()))


def _element_weights(adv: Tensor, mask: Tensor | None, weighting: Weighting) -> tuple[Tensor, Tensor]:
    """Broadcast advantages to the elements that count and give each its weight.

    Returns (values, weights) of the same shape; weights are 0 where masked.
    [B] advantages with a [B, T] mask: token weighting weighs sequence i by its length.
    [B, T] advantages: token weighting gives each unmasked token weight 1, sequence weighting
    gives each token 1 / len_i so every sequence sums to 1.
    """
    f = torch.promote_types(adv.dtype, torch.float32)
    adv = adv.to(f)
    if weighting not in ("token", "sequence"):
        raise ValueError(f"weighting must be 'token' or 'sequence', got {weighting!r}")
    if adv.dim() == 1:
        if mask is None or weighting == "sequence":
            w = torch.ones_like(adv)
            if mask is not None:
                w = (_as_mask(mask, adv.shape[0]).sum(dim=1) > 0).to(f)  # empty sequences do not count
            return adv, w
        return adv, _as_mask(mask, adv.shape[0]).sum(dim=1).to(f)
    if adv.dim() != 2:
        raise ValueError(f"advantages must be [B] or [B, T], got shape {tuple(adv.shape)}")
    m = torch.ones_like(adv, dtype=torch.bool) if mask is None else mask.bool()
    if m.shape != adv.shape:
        raise ValueError(f"mask {tuple(m.shape)} must match advantages {tuple(adv.shape)}")
    w = m.to(f)
    if weighting == "sequence":
        w = w / m.sum(dim=1, keepdim=True).clamp_min(1).to(f)
    return torch.where(m, adv, 0.0), w


def _as_mask(mask: Tensor, batch: int) -> Tensor:
    if mask.dim() != 2 or mask.shape[0] != batch:
        raise ValueError(f"mask must be [B={batch}, T], got shape {tuple(mask.shape)}")
    return mask.bool()


def _standardise(values: Tensor, weights: Tensor, eps: float) -> Tensor:
    total = weights.sum().clamp_min(torch.finfo(values.dtype).tiny)  # no host sync on GPU
    mean = (values * weights).sum() / total
    var = (((values - mean) ** 2) * weights).sum() / total
    std = var.sqrt()
    # std ~ 0 (one sequence, or all equal): exactly 0, not the rounding residue of the mean; do not divide.
    return torch.where(std > eps, (values - mean) / torch.where(std > eps, std, torch.ones_like(std)), 0.0)


def normalize(adv: Tensor, mask: Tensor | None = None, *, mode: NormMode = "minibatch",
              weighting: Weighting = "token", group_ids: Tensor | None = None,
              eps: float = 1e-6) -> Tensor:
    """Standardise the advantages of ONE optimizer minibatch (call it on the whole minibatch, before
    splitting into micro-batches / DP shards; the statistics are minibatch-wide).

    adv: `[B]` per sequence (mask `[B, T]` gives the token counts) or `[B, T]` per token.
    mode: `minibatch` (Magistral), `group` (standardise within each group given by `group_ids` `[B]`,
    GRPO-style), `none` (returned unchanged). Output has adv's shape; masked `[B, T]` entries are 0.
    eps: a (population) std <= eps counts as 0: the output is then exactly 0 (no signal, never nan/inf).
    """
    if mode == "none":
        return adv
    values, weights = _element_weights(adv, mask, weighting)
    if mode == "minibatch":
        out = _standardise(values, weights, eps)
    elif mode == "group":
        if group_ids is None or group_ids.shape != adv.shape[:1]:
            raise ValueError(f"mode='group' needs group_ids of shape [B]={tuple(adv.shape[:1])}")
        out = torch.zeros_like(values)
        for gid in torch.unique(group_ids):
            sel = group_ids == gid
            out[sel] = _standardise(values[sel], weights[sel], eps)
    else:
        raise ValueError(f"mode must be 'minibatch', 'group' or 'none', got {mode!r}")
    if out.dim() == 2:
        out = torch.where(weights > 0, out, 0.0)
    return out


@dataclass
class GroupAdvantages:
    """Advantages of the groups that carry signal, in the order of the kept groups."""

    advantages: Tensor  # [n_kept, G]
    keep: Tensor  # bool [n_groups]: which input groups they come from
    n_dropped: int  # non-diverse groups removed (log it)


def compute_group_advantages(rewards: Tensor, cfg) -> GroupAdvantages:
    """Rewards `[n_groups, G]` -> advantages per the AlgoConfig-like `cfg` (duck-typed so `algo/`
    imports nothing but torch): the one group-advantage rule of a run (control/budget.py applies it
    to each finished group). `pass_at_k` selects the pass@k estimator, with k clamped to G (a k
    above the group size trains pass@G), else r - group mean (divided by the group std if `adv_norm`
    is "group"); `drop_non_diverse_groups` filters constant groups.
    Minibatch normalisation (`normalize`, with cfg.adv_norm / cfg.adv_norm_weighting) comes later,
    per optimizer minibatch.
    """
    from .passk import pass_at_k_advantages

    if cfg.drop_non_diverse_groups:
        filt = filter_non_diverse(rewards)
    else:
        filt = GroupFilter(keep=torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device),
                           n_dropped=0)
    kept = rewards[filt.keep]
    if cfg.pass_at_k is not None:
        adv = pass_at_k_advantages(kept, min(cfg.pass_at_k, rewards.shape[1]))
    else:
        adv = group_advantages(kept, std=cfg.adv_norm == "group")
    return GroupAdvantages(advantages=adv, keep=filt.keep, n_dropped=filt.n_dropped)
