"""Per-token logprobs (and entropy) from vocab-parallel logits, without a full-vocab gather.

`token_logprobs(logits_local, targets, tp_group=None, vocab_size=None, chunk_tokens=None,
with_entropy=False)`:
- `logits_local`: `[..., V_local]`, this TP rank's contiguous vocab slice (rank r holds columns
  [r * V_local, (r + 1) * V_local)), as Megatron's output layer produces them.
- `targets`: `[...]` token ids in [0, vocab_size).
- `vocab_size`: the real vocab; columns at or beyond it (TP padding) are excluded.
- returns float32 logprobs `[...]` (and the entropy of the full distribution when asked).

Per chunk of tokens, the max and the sum of exp are all-reduced over the TP group and the target
logit comes from the rank that owns it, so communication is O(tokens), not O(tokens x vocab).
A custom autograd function saves only the logits (which exist anyway) and per-token statistics;
the backward recomputes the softmax chunk by chunk, so extra memory is O(chunk_tokens x V_local)
in both directions. Gradients: d logp / dx = onehot - p; d H / dx = -p (x - E_p[x]).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_DEFAULT_CHUNK_ELEMENTS = 1 << 24  # ~64 MB of float32 per chunk


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_stats(x: torch.Tensor, tgt: torch.Tensor, start: int, valid: int, group, with_entropy: bool):
    """x: [n, V_local] float32 chunk; returns (target logit, logsumexp, E_p[x] or None)."""
    xv = x[:, :valid]
    n = x.shape[0]
    if valid > 0:
        m = xv.max(dim=-1).values
    else:
        m = torch.full((n,), float("-inf"), device=x.device)
    m = _all_reduce(m, dist.ReduceOp.MAX, group)
    e = torch.exp(xv - m[:, None]) if valid > 0 else x.new_zeros(n, 0)
    stats = [e.sum(dim=-1)]
    local = tgt - start
    owned = (local >= 0) & (local < valid)
    idx = local.clamp(0, max(valid - 1, 0))
    tlogit = xv.gather(1, idx[:, None]).squeeze(1) if valid > 0 else x.new_zeros(n)
    stats.append(torch.where(owned, tlogit, torch.zeros_like(tlogit)))
    if with_entropy:
        stats.append((e * xv).sum(dim=-1))  # sum exp(x - m) x; divided by sum exp below
    packed = _all_reduce(torch.stack(stats), dist.ReduceOp.SUM, group)
    lse = m + packed[0].log()
    mean_x = packed[2] / packed[0] if with_entropy else None
    return packed[1], lse, mean_x


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, start, valid, chunk, with_entropy):
        n_tok = targets.numel()
        x2 = logits.reshape(n_tok, logits.shape[-1])
        t1 = targets.reshape(n_tok)
        logp = torch.empty(n_tok, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        mean_x = torch.empty_like(logp) if with_entropy else None
        for s in range(0, n_tok, chunk):
            sl = slice(s, min(s + chunk, n_tok))
            tl, l, mx = _chunk_stats(x2[sl].float(), t1[sl], start, valid, group, with_entropy)
            logp[sl] = tl - l
            lse[sl] = l
            if with_entropy:
                mean_x[sl] = mx
        # an output that takes no part in the loss (entropy kept for metrics) then arrives as None
        # in backward instead of zeros, and its term is skipped
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, lse, mean_x if with_entropy else lse)
        ctx.cfg = (start, valid, chunk, with_entropy)
        shape = targets.shape
        entropy = (lse - mean_x).reshape(shape) if with_entropy else logp.new_zeros(())
        return logp.reshape(shape), entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, mean_x = ctx.saved_tensors
        start, valid, chunk, with_entropy = ctx.cfg
        n_tok = targets.numel()
        vl = logits.shape[-1]
        x2 = logits.reshape(n_tok, vl)
        t1 = targets.reshape(n_tok)
        g_logp = torch.zeros(n_tok, device=logits.device) if g_logp is None else g_logp.reshape(n_tok).float()
        use_ent = with_entropy and g_ent is not None
        g_ent = g_ent.reshape(n_tok).float() if use_ent else None
        grad = torch.zeros_like(x2)
        for s in range(0, n_tok, chunk):
            sl = slice(s, min(s + chunk, n_tok))
            if valid == 0:
                continue
            x = x2[sl, :valid].float()
            p = torch.exp(x - lse[sl, None])
            g = -p * g_logp[sl, None]
            local = t1[sl] - start
            owned = (local >= 0) & (local < valid)
            rows = torch.nonzero(owned).squeeze(1)
            g[rows, local[rows]] += g_logp[sl][rows]
            if use_ent:
                g -= g_ent[sl, None] * p * (x - mean_x[sl, None])
            grad[sl, :valid] = g.to(grad.dtype)
        return grad.reshape(logits.shape), None, None, None, None, None, None


def token_logprobs(logits_local: torch.Tensor, targets: torch.Tensor, tp_group=None,
                   vocab_size: int | None = None, chunk_tokens: int | None = None,
                   with_entropy: bool = False):
    """Logprobs (float32, same shape as targets) of `targets`; `(logprobs, entropy)` if with_entropy."""
    if logits_local.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits_local.shape)} and targets {tuple(targets.shape)} disagree")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    vl = logits_local.shape[-1]
    vocab = vl * tp if vocab_size is None else int(vocab_size)
    if not (vl * (tp - 1) < vocab + vl and vocab <= vl * tp):
        raise ValueError(f"vocab_size={vocab} does not fit {tp} shards of {vl} columns")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"target ids must lie in [0, {vocab})")
    start = rank * vl
    valid = max(0, min(vl, vocab - start))
    chunk = chunk_tokens or max(1, _DEFAULT_CHUNK_ELEMENTS // max(vl, 1))
    logp, entropy = _VocabParallelLogprobs.apply(logits_local, targets.long(), tp_group, start, valid,
                                                 chunk, with_entropy)
    return (logp, entropy) if with_entropy else logp


def token_entropy(logits_local: torch.Tensor, tp_group=None, vocab_size: int | None = None,
                  chunk_tokens: int | None = None) -> torch.Tensor:
    """Entropy (float32, `[...]`) of the full-vocab distribution per token."""
    dummy = torch.zeros(logits_local.shape[:-1], dtype=torch.long, device=logits_local.device)
    return token_logprobs(logits_local, dummy, tp_group, vocab_size, chunk_tokens, with_entropy=True)[1]
