"""fused_clipped_loss: token-normalised clipped surrogate straight from (vocab-parallel) logits.

Forward: one pass over each row of logits (online log-sum-exp, target logit) -> per-token logprob ->
the reference surrogate on [tokens] values. Backward: d loss / d logits = coef_t * (onehot - softmax),
written by one kernel in the logits dtype; nothing float32 of size [tokens, vocab] is ever built.
Saved for backward: the logits (already alive in the caller's graph) and three float32 [tokens].

TP vocab padding (`vocab_size` < V_local * tp): the padded columns are left out of the softmax and get
a zero gradient. The kernels want dense rows, so only a rank whose shard ends in padding works on a
copy of its real columns (logits dtype); every other rank uses its logits as they are.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.algo.correction import ISCorrection

from . import _backend
from ._core import (SequenceKL, VocabShard, check_targets, flatten_token_inputs, loss_and_coef, pad_columns,
                    real_columns, reduce_stats, resolve_normalizer, shard_lse_stats)


class _FusedClippedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tok, eps_low, eps_high, normalizer, correction, shard, inplace_backward):
        z = real_columns(logits.reshape(-1, shard.size), shard)
        row_max, row_sum, target_logit = shard_lse_stats(z, tok.targets, shard)
        lse, target_logit = reduce_stats(row_max, row_sum, target_logit, shard)
        logp = target_logit - lse
        need_grad = ctx.needs_input_grad[0]
        loss, coef = loss_and_coef(logp, tok, slice(None), eps_low, eps_high, normalizer, correction,
                                   need_grad)
        if need_grad:
            ctx.save_for_backward(z, tok.targets, lse, coef)
        ctx.shard, ctx.logits_shape, ctx.inplace = shard, logits.shape, inplace_backward
        logp = logp.detach().view(tok.shape)
        ctx.mark_non_differentiable(logp)
        return loss, logp

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp):
        z, targets, lse, coef = ctx.saved_tensors
        shard = ctx.shard
        if shard.valid == 0:
            grad = z.new_zeros(z.shape[0], shard.size)
        else:
            scaled = (coef * grad_loss.to(coef.dtype)).float()
            grad = pad_columns(_backend.logits_grad(z, targets, lse, scaled, shard.start,
                                                    inplace=ctx.inplace), shard)
        return grad.view(ctx.logits_shape), None, None, None, None, None, None, None


def fused_clipped_loss(logits: Tensor, targets: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                       mask: Tensor, eps_low: float = 0.2, eps_high: float = 0.28, tp_group=None, *,
                       normalizer=None, inplace_backward: bool = False, tis_cap: float | None = None,
                       proximal_logprobs: Tensor | None = None, vocab_size: int | None = None,
                       return_logprobs: bool = False, kl: SequenceKL | None = None,
                       correction: ISCorrection | None = None, segment_ids: Tensor | None = None):
    """Scalar loss equal (value and gradient) to
    `clipped_token_loss(log_softmax(logits).gather(targets), behaviour_logprobs, advantages, mask, ...)`.

    logits: `[B, T, V_local]` float32/bfloat16/float16 (float64 runs the PyTorch path); under tensor
        parallelism each rank of `tp_group` holds vocab slice `[rank * V_local, (rank + 1) * V_local)`
        (Megatron's equal split) and gets the gradient of its slice; the loss is the same on all ranks.
    targets: `[B, T]` global token ids (any value on masked positions).
    behaviour_logprobs, mask: `[B, T]`; advantages: `[B]` or `[B, T]`.
    normalizer: unmasked-token count of the whole minibatch (micro-batch accumulation / DP); None ->
        mask.sum() of this call. tis_cap, proximal_logprobs: as in `clipped_token_loss`.
    inplace_backward: write the gradient into the logits buffer (saves one logits-sized tensor; the
        logits must not be used by anything else after backward, autograd checks saved uses).
    vocab_size: the real vocabulary when the logits carry TP padding (Megatron pads the vocab to a
        multiple of tp): columns at or beyond it are excluded from the softmax and get zero gradient.
        None -> every column is real.
    return_logprobs: also return the detached per-token logprobs `[B, T]` (float32; float64 for float64
        logits) that the forward computed
        (for ratio/clip statistics without a second pass): `(loss, logprobs)`.
    kl: a sequence-level k2 term to add (`SequenceKL`: reference logprobs, which sequence each token
        belongs to, weight); it is O(tokens) and enters the same per-token gradient coefficient.
    correction, segment_ids: the importance-sampling correction (`algo.correction.ISCorrection`, in
        place of `tis_cap`) and, for sequence_tis, which sequence of a packed row each token is of
        (`[B, T]`; None: one sequence per row). As in `clipped_token_loss`.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V_local], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if correction is not None and tis_cap is not None:
        raise ValueError("pass tis_cap or correction, not both (the correction carries its cap)")
    correction = correction if correction is not None else ISCorrection("token_tis", tis_cap)
    tok = flatten_token_inputs(logits.shape[:2], targets, behaviour_logprobs, advantages, mask,
                               proximal_logprobs, kl, segment_ids)
    shard = VocabShard.of(logits.shape[-1], tp_group, vocab_size)
    check_targets(tok, shard.vocab_size)
    norm = resolve_normalizer(tok.mask, normalizer)
    loss, logp = _FusedClippedLoss.apply(logits, tok, eps_low, eps_high, norm, correction, shard,
                                         inplace_backward)
    return (loss, logp) if return_logprobs else loss


def token_logprobs(logits: Tensor, targets: Tensor, tp_group=None, vocab_size: int | None = None) -> Tensor:
    """Detached per-token logprobs `[B, T]` (float32) of `targets` with the same fused kernels."""
    if logits.dim() != 3 or tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"need logits [B, T, V] and targets [B, T], got {tuple(logits.shape)}, "
                         f"{tuple(targets.shape)}")
    shard = VocabShard.of(logits.shape[-1], tp_group, vocab_size)
    with torch.no_grad():
        z = real_columns(logits.reshape(-1, shard.size), shard)
        stats = shard_lse_stats(z, targets.reshape(-1).to(torch.int64).contiguous(), shard)
        lse, target_logit = reduce_stats(*stats, shard)
    return (target_logit - lse).view(targets.shape)
