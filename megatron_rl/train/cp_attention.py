"""Context-parallel core attention for the local spec (CPU / gloo): K/V all-gathered over the CP group.

Layout (Megatron's load balancing, `packing.cp_token_index`): every segment of the whole packed row
is a multiple of 2*CP tokens long and cut into 2*CP equal chunks; CP rank r holds chunks r and
2*CP-1-r of each segment, segment after segment. Each rank all-gathers K and V of the other ranks
(autograd-aware: the backward sums the K/V gradients of every rank and keeps its own slice, i.e. a
reduce-scatter), rebuilds each segment's keys in their global order, and attends its own queries
with the causal (and sliding-window) mask of their global positions. Causality makes each rank's
work about equal: chunk r sees r+1 chunks of keys, chunk 2*CP-1-r sees 2*CP-r.

Cost per rank: K/V of the whole row (the all-gather variant of CP; Transformer Engine's p2p ring on
GPU never holds them all), and scores for 2*L/(2*CP) queries x up to L keys per segment of length L.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _GatherOverCP(torch.autograd.Function):
    """[...] local -> [cp, ...] stacked in rank order; backward: sum over ranks, own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        # every rank's queries read this rank's keys: their gradients add up here
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gather_over_cp(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherOverCP.apply(x, group)


def chunk_positions(length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions inside a segment of `length` tokens of the 2*length/(2*cp) tokens rank `cp_rank` holds."""
    c = length // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, second])


def _segment_keys(kv_all: torch.Tensor, offset: int, length: int, cp_size: int) -> torch.Tensor:
    """kv_all [cp, b, h, s_local, hn]; the segment starting at local `offset` on every rank -> its keys
    in global order [b, h, length, hn]."""
    c = length // (2 * cp_size)
    chunks = []
    for j in range(2 * cp_size):
        owner, where = (j, offset) if j < cp_size else (2 * cp_size - 1 - j, offset + c)
        chunks.append(kv_all[owner, :, :, where:where + c])
    return torch.cat(chunks, dim=2)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[tuple[int, int]],
                 group, scale: float, window_left: int | None, gqa: bool) -> torch.Tensor:
    """q [b, np, s_local, hn], k/v [b, ng, s_local, hn] (this rank's chunks); `segments`: the whole
    row's (start, end) boundaries. Returns [b, np, s_local, hn]."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    kv_all = gather_over_cp(torch.cat([k, v], dim=1), group)  # one collective for K and V
    ng = k.shape[1]
    outs, offset = [], 0
    for a, e in segments:
        length = e - a
        if length % (2 * cp_size):
            raise ValueError(f"segment [{a}, {e}) is not a multiple of 2*CP={2 * cp_size} tokens "
                             "(pack with seq_multiple=2*CP)")
        n_local = length // cp_size
        qpos = chunk_positions(length, cp_size, cp_rank, q.device)
        last = int(qpos[-1]) + 1  # keys beyond the last query are masked for every query: skip them
        keys = _segment_keys(kv_all, offset, length, cp_size)[:, :, :last]
        kpos = torch.arange(last, device=q.device)
        d = qpos[:, None] - kpos[None, :]
        mask = d >= 0
        if window_left is not None:
            mask &= d <= window_left
        outs.append(F.scaled_dot_product_attention(
            q[:, :, offset:offset + n_local], keys[:, :ng], keys[:, ng:], attn_mask=mask, scale=scale,
            enable_gqa=gqa))
        offset += n_local
    if offset != q.shape[2]:
        raise ValueError(f"cu_seqlens describe {offset} local tokens per CP rank, input has {q.shape[2]}")
    return torch.cat(outs, dim=2)
