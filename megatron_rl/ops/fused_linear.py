"""fused_linear_clipped_loss: the clipped loss from hidden states and the output weight, in token chunks.

The [tokens, vocab] logits never exist in full: each chunk of tokens gets its logits (hidden_c @ W^T),
its log-sum-exp (and, under TP, the two small all-reduces), its reference loss and d loss / d logprob,
and then — because the loss is a sum over tokens with a normaliser fixed up front — its gradient
right away: the chunk's logits buffer is overwritten in place by d loss / d logits, which gives
grad_hidden_c = G_c @ W and grad_W += G_c^T @ hidden_c. Backward only scales the stored gradients by
the incoming scalar. Peak extra memory: one chunk of logits plus grad_hidden and grad_W (the sizes of
hidden and W). Three GEMMs per chunk, no recomputation.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.algo.correction import ISCorrection

from . import _backend
from ._core import (VocabShard, check_targets, flatten_token_inputs, loss_and_coef, reduce_stats,
                    resolve_normalizer, shard_lse_stats)

CHUNK_LOGIT_ELEMENTS = 1 << 26  # default chunk: tokens * V_local <= 64 Mi logits (128 MiB in bf16)


class _FusedLinearClippedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tok, eps_low, eps_high, normalizer, tis_cap, shard, chunk,
                reduce_grad_hidden):
        x = hidden.reshape(-1, hidden.shape[-1])
        n = x.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None  # TP padding rows keep a zero gradient
        w = weight[: shard.valid]  # the real vocab rows (a view: rows are contiguous)
        gw = None if grad_w is None else grad_w[: shard.valid]
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            logits = x[a:b] @ w.t()  # [chunk, valid], the only vocab-sized buffer
            targets = tok.targets[a:b]
            lse, target_logit = reduce_stats(*shard_lse_stats(logits, targets, shard), shard)
            part, coef = loss_and_coef(target_logit - lse, tok, slice(a, b), eps_low, eps_high,
                                       normalizer, ISCorrection("token_tis", tis_cap), need_h or need_w)
            loss = loss + part.to(loss.dtype)
            if not (need_h or need_w):
                continue
            if shard.valid == 0:  # nothing of this rank's vocab is real: zero local gradients
                if need_h:
                    grad_x[a:b].zero_()
                continue
            g = _backend.logits_grad(logits, targets, lse, coef.float(), shard.start, inplace=True)
            if need_h:
                torch.mm(g, w, out=grad_x[a:b])
            if need_w:
                gw.addmm_(g.t(), x[a:b])
        if need_h and shard.group is not None and reduce_grad_hidden:
            dist.all_reduce(grad_x, op=dist.ReduceOp.SUM, group=shard.group)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.hidden_shape = hidden.shape
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        gh = None if grad_x is None else (grad_x * grad_loss.to(grad_x.dtype)).view(ctx.hidden_shape)
        gw = None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype)
        return gh, gw, None, None, None, None, None, None, None, None


def fused_linear_clipped_loss(hidden: Tensor, weight: Tensor, targets: Tensor, behaviour_logprobs: Tensor,
                              advantages: Tensor, mask: Tensor, eps_low: float = 0.2,
                              eps_high: float = 0.28, tp_group=None, *, normalizer=None,
                              chunk_tokens: int | None = None, reduce_grad_hidden: bool = True,
                              tis_cap: float | None = None,
                              proximal_logprobs: Tensor | None = None,
                              vocab_size: int | None = None) -> Tensor:
    """Same value and gradient as `fused_clipped_loss(hidden @ weight.T, ...)`, in chunks of tokens.

    hidden: `[B, T, H]`; weight: `[V_local, H]` (the output layer; under TP each rank holds vocab rows
        `[rank * V_local, (rank + 1) * V_local)`, as Megatron's ColumnParallelLinear). Same dtype.
    chunk_tokens: tokens per chunk (default: CHUNK_LOGIT_ELEMENTS // V_local).
    reduce_grad_hidden: under TP, all-reduce the hidden-state gradient (each rank only sees its vocab
        slice). Set False when the caller's graph already does it (Megatron's
        copy_to_tensor_model_parallel_region in front of the output layer).
    vocab_size: the real vocabulary when the output weight carries TP padding rows (excluded from the
        softmax, zero gradient); None -> every row is real.
    The weight gradient is accumulated over chunks in the weight dtype (fp32 for fp32 weights).
    Other arguments as in `fused_clipped_loss`. Double backward is not supported.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"weight must be [V_local, H={hidden.shape[2]}], got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(f"hidden and weight must share dtype/device, got {hidden.dtype}/{hidden.device} "
                        f"and {weight.dtype}/{weight.device}")
    tok = flatten_token_inputs(hidden.shape[:2], targets, behaviour_logprobs, advantages, mask,
                               proximal_logprobs)
    shard = VocabShard.of(weight.shape[0], tp_group, vocab_size)
    check_targets(tok, shard.vocab_size)
    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_LOGIT_ELEMENTS // weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    norm = resolve_normalizer(tok.mask, normalizer)
    return _FusedLinearClippedLoss.apply(hidden, weight, tok, eps_low, eps_high, norm, tis_cap, shard,
                                         int(chunk_tokens), reduce_grad_hidden)
