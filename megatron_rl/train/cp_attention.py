"""Context-parallel core attention for the local spec (CPU / gloo): K/V all-gathered over the CP group.

Layout (Megatron's load balancing, `packing.cp_token_index`): every segment of the whole packed row
is a multiple of 2*CP tokens long and cut into 2*CP equal chunks; CP rank r holds chunks r and
2*CP-1-r of each segment, segment after segment. Each rank all-gathers K and V of the other ranks
(autograd-aware: the backward sums the K/V gradients of every rank and keeps its own slice, i.e. a
reduce-scatter), rebuilds each segment's keys in their global order, and attends its own queries
with the causal (and sliding-window) mask of their global positions. Causality makes each rank's
work about equal: chunk r sees r+1 chunks of keys, chunk 2*CP-1-r sees 2*CP-r.

Each query chunk of c tokens at segment positions [p, p + c) sees keys [0, p + c): a lower-right
aligned causal pattern. Without a sliding window, on CPU, `prefix_causal_attention` computes it with no
[queries, keys] mask: the fused CPU flash kernel attends the chunk to its unmasked key prefix [0, p)
and, causally, to its own square diagonal block [p, p + c), and the two are merged by their
log-sum-exps; the backward runs the kernel's own backward on each block with the merged output and
log-sum-exp, which is exact (the softmax of each row is the merged one). A boolean mask handed to CPU
SDPA instead becomes a float32 copy saved for the backward (chunk queries x keys x 4 bytes per
segment and layer: 256 MB per rank in benchmarks/context_parallel.py). Other devices use torch's
`causal_lower_right` bias (their flash / memory-efficient kernels take the alignment; on CPU it would be
materialised). A sliding window that hides keys keeps the explicit mask.

Cost per rank: K/V of the whole row (the all-gather variant of CP; Transformer Engine's p2p ring on
GPU never holds them all), and scores for 2*L/(2*CP) queries x up to L keys per segment of length L
(computed block by block inside the kernel, never stored).
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


def _flash_cpu(q, k, v, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


class _PrefixCausalCPU(torch.autograd.Function):
    """q [b, np, c, hn] at the last c of the s + c key positions of k/v [b, ng, s + c, hn]: query i sees
    keys [0, s + i]. Forward: unmasked prefix block + causal diagonal block, merged by log-sum-exp (in
    float32). Backward: the flash backward of each block with the merged output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        prefix = k.shape[2] - q.shape[2]
        out, lse = _flash_cpu(q, k[:, :, prefix:], v[:, :, prefix:], True, scale)
        if prefix:
            out_p, lse_p = _flash_cpu(q, k[:, :, :prefix], v[:, :, :prefix], False, scale)
            merged = torch.logaddexp(lse_p, lse)
            out = (out_p.float() * (lse_p - merged).exp().unsqueeze(-1)
                   + out.float() * (lse - merged).exp().unsqueeze(-1)).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        prefix = k.shape[2] - q.shape[2]
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq, dk, dv = backward(grad, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, 0.0, True, scale=ctx.scale)
        if prefix:
            dq_p, dk_p, dv_p = backward(grad, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, 0.0, False,
                                        scale=ctx.scale)
            dq, dk, dv = dq + dq_p, torch.cat([dk_p, dk], dim=2), torch.cat([dv_p, dv], dim=2)
        return dq, dk, dv, None


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Lower-right aligned causal attention (query i of c sees keys [0, len(k) - c + i]), GQA allowed,
    with no [c, len(k)] mask: the CPU kernel's blocks, or torch's `causal_lower_right` bias elsewhere."""
    if q.device.type == "cpu":
        return _PrefixCausalCPU.apply(q, k, v, scale)
    from torch.nn.attention.bias import causal_lower_right

    k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          scale=scale)


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
        mine = q[:, :, offset:offset + n_local]
        if window_left is None or window_left >= last - 1:  # no window, or one that hides no key
            c = n_local // 2  # two chunks; the first sees keys up to its own last position
            first_end = (cp_rank + 1) * c
            outs += [prefix_causal_attention(mine[:, :, :c], keys[:, :ng, :first_end], keys[:, ng:, :first_end],
                                             scale),
                     prefix_causal_attention(mine[:, :, c:], keys[:, :ng], keys[:, ng:], scale)]
        else:
            d = qpos[:, None] - torch.arange(last, device=q.device)[None, :]
            mask = (d >= 0) & (d <= window_left)
            outs.append(F.scaled_dot_product_attention(mine, keys[:, :ng], keys[:, ng:], attn_mask=mask,
                                                       scale=scale, enable_gqa=gqa))
        offset += n_local
    if offset != q.shape[2]:
        raise ValueError(f"cu_seqlens describe {offset} local tokens per CP rank, input has {q.shape[2]}")
    return torch.cat(outs, dim=2)
