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
materialised). A sliding window that hides keys: on CPU, `window_causal_attention` (flash blocks again,
each chunk over the keys of its window only); elsewhere an explicit boolean mask.

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


def _flash_block(q, k, v, mode: str, scale: float):
    """One key block for every query: 'full' (unmasked), 'causal' (square, query i sees keys <= i) or
    'anticausal' (square, query i sees keys >= i: the causal kernel on both sequences reversed)."""
    if mode == "anticausal":
        out, lse = _flash_cpu(q.flip(2), k.flip(2), v.flip(2), True, scale)
        return out.flip(2), lse.flip(-1)
    return _flash_cpu(q, k, v, mode == "causal", scale)


def _flash_block_backward(grad, q, k, v, out, lse, mode: str, scale: float):
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    if mode == "anticausal":
        grads = backward(grad.flip(2), q.flip(2), k.flip(2), v.flip(2), out.flip(2), lse.flip(-1), 0.0, True,
                         scale=scale)
        return tuple(g.flip(2) for g in grads)
    return backward(grad, q, k, v, out, lse, 0.0, mode == "causal", scale=scale)


class _TilesCPU(torch.autograd.Function):
    """q [b, np, c, hn] cut into query tiles, each over its disjoint key blocks of k/v [b, ng, s, hn]:
    `tiles` = ((q_start, q_end, ((k_start, k_end, mode), ...)), ...) covering the queries in order (keys
    in no block of a tile are hidden from it). Forward: each block by the fused CPU flash kernel, a tile's
    blocks merged by their log-sum-exps (in float32). Backward: the flash backward of each block with
    the merged output and log-sum-exp (exact: the softmax of each row is the merged one); K/V gradients
    of all tiles summed in float32 and rounded once."""

    @staticmethod
    def forward(ctx, q, k, v, tiles, scale):
        outs, lses = [], []
        for q0, q1, blocks in tiles:
            parts = [_flash_block(q[:, :, q0:q1], k[:, :, a:e], v[:, :, a:e], mode, scale) for a, e, mode in blocks]
            if len(parts) == 1:
                out, lse = parts[0]
            else:
                lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
                out = sum(part.float() * (part_lse - lse).exp().unsqueeze(-1) for part, part_lse in parts)
                out = out.to(q.dtype)
            outs.append(out)
            lses.append(lse)
        out, lse = (outs[0], lses[0]) if len(tiles) == 1 else (torch.cat(outs, dim=2), torch.cat(lses, dim=2))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tiles, ctx.scale = tiles, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for q0, q1, blocks in ctx.tiles:
            rows = slice(q0, q1)
            for a, e, mode in blocks:
                dq_b, dk_b, dv_b = _flash_block_backward(grad[:, :, rows], q[:, :, rows], k[:, :, a:e], v[:, :, a:e],
                                                         out[:, :, rows], lse[:, :, rows], mode, ctx.scale)
                dq[:, :, rows] += dq_b
                dk[:, :, a:e] += dk_b
                dv[:, :, a:e] += dv_b
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _prefix_blocks(prefix: int, end: int) -> tuple:
    """Key blocks of queries at the last end - prefix positions seeing keys [0, own position]."""
    return ((0, prefix, "full"), (prefix, end, "causal")) if prefix else ((0, end, "causal"),)


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Lower-right aligned causal attention (query i of c sees keys [0, len(k) - c + i]), GQA allowed,
    with no [c, len(k)] mask: the CPU kernel's blocks, or torch's `causal_lower_right` bias elsewhere."""
    if q.device.type == "cpu":
        return _TilesCPU.apply(q, k, v, ((0, q.shape[2], _prefix_blocks(k.shape[2] - q.shape[2], k.shape[2])),),
                               scale)
    from torch.nn.attention.bias import causal_lower_right

    k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          scale=scale)


def window_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, window: int,
                            scale: float) -> torch.Tensor:
    """CPU sliding-window causal attention with no [queries, keys] mask: q [b, np, c, hn] at positions
    [first, first + c) of k/v [b, ng, first + c, hn]; the query at position t sees keys
    [max(0, t - window), t]. Queries at positions <= window see their whole prefix (one prefix-causal
    tile); the others go in tiles of at most `window` queries [s, s + n), each over the keys
    [s - window, s + n): an anticausal square [s - window, s - window + n) (the window's lower edge), an
    unmasked block up to s and the causal diagonal square [s, s + n)."""
    if window < 1:
        raise ValueError(f"window_causal_attention needs a window of at least 1 key back, got {window}")
    c = q.shape[2]
    head = min(c, max(0, window + 1 - first))  # queries whose window reaches key 0
    tiles = [(0, head, _prefix_blocks(first, first + head))] if head else []
    s = first + head
    while s < first + c:
        n = min(window, first + c - s)
        blocks = ((s - window, s - window + n, "anticausal"), (s - window + n, s, "full"), (s, s + n, "causal"))
        tiles.append((s - first, s - first + n, tuple(b for b in blocks if b[1] > b[0])))
        s += n
    return _TilesCPU.apply(q, k, v, tuple(tiles), scale)


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
        c = n_local // 2  # two chunks; the first sees keys up to its own last position
        first_end = (cp_rank + 1) * c
        if window_left is None or window_left >= last - 1:  # no window, or one that hides no key
            outs += [prefix_causal_attention(mine[:, :, :c], keys[:, :ng, :first_end], keys[:, ng:, :first_end],
                                             scale),
                     prefix_causal_attention(mine[:, :, c:], keys[:, :ng], keys[:, ng:], scale)]
        elif q.device.type == "cpu" and window_left >= 1:  # each chunk over the keys of its window only
            outs += [window_causal_attention(mine[:, :, :c], keys[:, :ng, :first_end], keys[:, ng:, :first_end],
                                             int(qpos[0]), window_left, scale),
                     window_causal_attention(mine[:, :, c:], keys[:, :ng], keys[:, ng:], int(qpos[c]), window_left,
                                             scale)]
        else:
            d = qpos[:, None] - torch.arange(last, device=q.device)[None, :]
            mask = (d >= 0) & (d <= window_left)
            outs.append(F.scaled_dot_product_attention(mine, keys[:, :ng], keys[:, ng:], attn_mask=mask,
                                                       scale=scale, enable_gqa=gqa))
        offset += n_local
    if offset != q.shape[2]:
        raise ValueError(f"cu_seqlens describe {offset} local tokens per CP rank, input has {q.shape[2]}")
    return torch.cat(outs, dim=2)
