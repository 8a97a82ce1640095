"""Trainer/generator logprob mismatch, by weight-version lag (the `mismatch/...` metrics).

For each completion token: d = trainer logprob (the weights at the start of the update) - generator
logprob (what the generator reported when it sampled the token), and its version lag = the trainer's
version - the version of the weights that sampled it. Tokens are binned by lag: 0, 1, ..., LAG_BINS - 1
each, the rest together as `lag{LAG_BINS}+`. Per bin:

- `tokens`: how many tokens;
- `abs_mean`, `abs_max`: mean and max of |d|;
- `log_ratio_mean`: mean of d (its sign says which side is more confident);
- `kl_k3`: mean over tokens of k3 = exp(d) - 1 - d, Schulman's k3 estimate (ratio exp(d)), under the generator's
  samples, of each token's KL(pi_generator(.|prefix) || pi_trainer(.|prefix)): unbiased, >= 0 per
  sample, and about d^2 / 2 for small d;
- `out_of_band_frac`: fraction of tokens whose ratio exp(d) leaves [BAND_LOW, BAND_HIGH].

At lag 0 the two sides hold the same weights, so the numbers measure numerics alone (kernels,
precision, batching); at lag k > 0 they add k updates of policy change.

Lag 0 is also split by what the token attended to (`lag0_pure`, `lag0_mixed`): with in-place weight
updates a sequence keeps its KV cache across an update, so a token sampled by version v may attend to
keys and values older weights computed, while the trainer recomputes its whole context under one
version. A model token's context is *mixed* when an earlier model token of its turn has another
version (`mixed_context`), *pure* otherwise. Per turn, not per sequence: each turn of an episode is a
new request that prefills its whole context under the weights it starts on (rollout/episode.py), and
that prefill's forward samples the turn's first token, so the turn's first version is also its
prompt's. A turn is a maximal run of model tokens (environment tokens separate turns).
Sums are kept per bin so micro-batches, ranks and minibatches combine exactly (`merge`).
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch
from torch import Tensor

LAG_BINS = 3  # lags 0, 1, 2 each, then one bin for >= 3
LAG0_SPLIT = ("lag0_pure", "lag0_mixed")  # lag 0 again, by the versions of the token's context
N_BINS = LAG_BINS + 1 + len(LAG0_SPLIT)
BAND_LOW, BAND_HIGH = 0.5, 2.0
SUM_FIELDS = ("tokens", "abs_sum", "log_ratio_sum", "k3_sum", "out_of_band")
PREFIX = "mismatch/"
_TURN_STRIDE = 1 << 32  # turn index * stride + version: one cummax runs over the turns of a row in order


def bin_names() -> list[str]:
    return [f"lag{k}" for k in range(LAG_BINS)] + [f"lag{LAG_BINS}+", *LAG0_SPLIT]


def mixed_context(versions: Tensor, model: Tensor) -> Tensor:
    """Per token of one completion `[n]`: True where an earlier model token of the same turn has another
    version than this one (the module docstring's rule). `versions` long, `model` the loss mask (1 =
    model token, 0 = environment token, whose own entry is False and means nothing)."""
    model = model.bool()
    starts = model & ~torch.cat([model.new_zeros(1), model[:-1]])  # first model token of each turn
    turn = torch.cumsum(starts.long(), 0)
    v = torch.where(model, versions.long(), 0)
    # running max and min of the versions since the turn began (the turn index keeps turns apart)
    high = torch.cummax(turn * _TURN_STRIDE + v, 0).values - turn * _TURN_STRIDE
    low = turn * _TURN_STRIDE - torch.cummax(turn * _TURN_STRIDE - v, 0).values
    return model & ((high != v) | (low != v))


def mismatch_sums(trainer_logprobs: Tensor, generator_logprobs: Tensor, lag: Tensor,
                  mask: Tensor, mixed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-bin sums `[N_BINS, len(SUM_FIELDS)]` and max |d| `[N_BINS]` (0 for an empty bin), float32 on
    the inputs' device, no host sync. Tokens with a negative lag (version unknown) are left out.
    `mixed` (`mixed_context` per token): splits lag 0 into its pure and mixed bins (None: both empty)."""
    d = (trainer_logprobs.float() - generator_logprobs.float()).detach()
    keep = mask.bool() & (lag >= 0)
    d = torch.where(keep, d, 0.0)
    bins = lag.clamp(0, LAG_BINS).to(torch.int64)
    by_lag = (bins[..., None] == torch.arange(LAG_BINS + 1, device=d.device)) & keep[..., None]
    lag0 = by_lag[..., 0] if mixed is not None else torch.zeros_like(keep)
    mixed = torch.zeros_like(keep) if mixed is None else mixed.bool()
    onehot = torch.cat([by_lag, (lag0 & ~mixed)[..., None], (lag0 & mixed)[..., None]], dim=-1)
    w = onehot.reshape(-1, N_BINS).float()  # [N, n_bins]
    a = d.abs().reshape(-1)
    per_token = torch.stack([torch.ones_like(a), a, d.reshape(-1), torch.expm1(d).reshape(-1) - d.reshape(-1),
                             ((d < math.log(BAND_LOW)) | (d > math.log(BAND_HIGH))).reshape(-1).float()], dim=1)
    sums = w.t() @ per_token  # [n_bins, fields]
    maxes = (w * a[:, None]).amax(dim=0) if a.numel() else torch.zeros(N_BINS, device=d.device)
    return sums, maxes


def metrics(sums: Tensor | Iterable, maxes: Tensor | Iterable) -> dict[str, float]:
    """`mismatch/<bin>/<name>` for every bin with tokens (host floats)."""
    s = torch.as_tensor(sums, dtype=torch.float64).reshape(N_BINS, len(SUM_FIELDS)).tolist()
    m = torch.as_tensor(maxes, dtype=torch.float64).reshape(-1).tolist()
    out: dict[str, float] = {}
    for name, row, mx in zip(bin_names(), s, m):
        n, abs_sum, lr_sum, k3_sum, out_n = row
        if n <= 0:
            continue
        key = f"{PREFIX}{name}/"
        out.update({key + "tokens": n, key + "abs_mean": abs_sum / n, key + "abs_max": mx,
                    key + "log_ratio_mean": lr_sum / n, key + "kl_k3": k3_sum / n,
                    key + "out_of_band_frac": out_n / n})
    return out


def merge(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine the `mismatch/...` metrics of several minibatches: token-weighted means, max of maxes."""
    acc: dict[str, dict[str, float]] = {}
    for part in parts:
        for name in bin_names():
            key = f"{PREFIX}{name}/"
            n = part.get(key + "tokens", 0.0)
            if not n:
                continue
            a = acc.setdefault(name, {"tokens": 0.0, "abs_max": 0.0})
            a["tokens"] += n
            a["abs_max"] = max(a["abs_max"], part[key + "abs_max"])
            for field in ("abs_mean", "log_ratio_mean", "kl_k3", "out_of_band_frac"):
                a[field] = a.get(field, 0.0) + n * part[key + field]
    out: dict[str, float] = {}
    for name, a in acc.items():
        key = f"{PREFIX}{name}/"
        n = a["tokens"]
        out.update({key + "tokens": n, key + "abs_max": a["abs_max"]})
        out.update({key + f: a[f] / n for f in ("abs_mean", "log_ratio_mean", "kl_k3", "out_of_band_frac")})
    return out
