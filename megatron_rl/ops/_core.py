"""Shared pieces of the fused losses: input checks, the vocab-parallel log-sum-exp reduction, and the
per-token loss/gradient coefficient taken from the reference `algo.loss.clipped_token_loss`.

The surrogate itself is O(tokens) work, so it is not re-implemented here: the fused ops evaluate the
reference on the (detached) per-token logprobs and ask autograd for d loss / d logprob. Values and
gradients therefore match the reference by construction, options included; only the O(tokens x vocab)
part (log-softmax, its backward) is fused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.algo.correction import ISCorrection
from megatron_rl.algo.kl import kl_k2_segment_sum
from megatron_rl.algo.loss import clipped_token_loss

from . import _backend


@dataclass
class TokenInputs:
    """Per-token inputs flattened to [N] (advantages broadcast), plus the original [B, T] shape."""

    targets: Tensor  # int64 [N], global vocab ids
    behaviour: Tensor  # [N]
    advantages: Tensor  # [N]
    mask: Tensor  # bool [N]
    proximal: Tensor | None  # [N] or None
    shape: tuple[int, int]
    kl: "SequenceKL | None" = None  # flattened to [N] tensors
    segments: Tensor | None = None  # int64 [N]: which sequence each token is of (one id space)


@dataclass
class SequenceKL:
    """A sequence-level k2 KL term added to the fused loss: `weight * sum_i 1/2 (sum_{t in i}
    (logp_t - ref_logprobs_t))^2` over the unmasked tokens, sequences given by `segment_ids` (a packed
    row holds several). Its gradient is a sample of grad KL(pi || ref) (see algo.kl). Shapes `[B, T]`.
    `n_segments`: max(segment_ids) + 1 of a single row (B = 1, the trainer's packed layout) when the
    caller knows it on the host (a packed row: its cu_seqlens intervals, padding included, each on every
    CP rank), so the loss reads nothing back from the device; None: it is read."""

    ref_logprobs: Tensor
    segment_ids: Tensor
    weight: float
    n_segments: int | None = None


@dataclass
class VocabShard:
    """Which slice [start, start + size) of the (padded) vocabulary this rank's logits hold, and how
    many of its leading columns are real (`valid`; the rest is TP padding beyond `vocab_size`)."""

    start: int
    size: int
    world: int
    group: object | None
    valid: int = -1  # -1: all `size` columns
    vocab_size: int = -1  # real vocabulary; -1: size * world

    def __post_init__(self) -> None:
        if self.valid < 0:
            self.valid = self.size
        if self.vocab_size < 0:
            self.vocab_size = self.size * self.world

    @property
    def padded(self) -> bool:
        return self.valid < self.size

    @classmethod
    def of(cls, local_vocab: int, tp_group, vocab_size: int | None = None) -> "VocabShard":
        if tp_group is None or dist.get_world_size(tp_group) == 1:
            world, rank, group = 1, 0, None
        else:
            world, rank, group = dist.get_world_size(tp_group), dist.get_rank(tp_group), tp_group
        total = local_vocab * world
        vocab = total if vocab_size is None else int(vocab_size)
        if not (0 < vocab <= total):
            raise ValueError(f"vocab_size={vocab} does not fit {world} shard(s) of {local_vocab} columns "
                             f"(need 0 < vocab_size <= {total})")
        start = rank * local_vocab
        # valid may be 0: a shard of nothing but padding (only with tiny vocabularies at large TP)
        return cls(start, local_vocab, world, group, valid=max(0, min(local_vocab, vocab - start)),
                   vocab_size=vocab)


def real_columns(z: Tensor, shard: VocabShard) -> Tensor:
    """[N, V_local] -> the real columns [N, valid] as a contiguous tensor in the logits dtype (a copy
    only on a rank whose shard ends in TP padding; the kernels need dense rows)."""
    if not shard.padded:
        return z if z.is_contiguous() else z.contiguous()
    return z[:, : shard.valid].contiguous()


def shard_lse_stats(z_real: Tensor, targets: Tensor, shard: VocabShard):
    """`_backend.lse_stats` of the real columns; a shard without any gives (-inf, 0, 0) per row,
    which the TP reduction treats as "no contribution"."""
    if shard.valid == 0:
        n = z_real.shape[0]
        acc = torch.float64 if z_real.dtype == torch.float64 else torch.float32
        zeros = torch.zeros(n, dtype=acc, device=z_real.device)
        return torch.full_like(zeros, float("-inf")), zeros, zeros.clone()
    return _backend.lse_stats(z_real, targets, shard.start)


def pad_columns(grad: Tensor, shard: VocabShard) -> Tensor:
    """Gradient of the real columns -> [N, V_local] with zeros on the padding columns."""
    if not shard.padded:
        return grad
    full = grad.new_zeros(grad.shape[0], shard.size)
    full[:, : shard.valid] = grad
    return full


def flatten_token_inputs(batch_shape, targets, behaviour_logprobs, advantages, mask,
                         proximal_logprobs=None, kl: SequenceKL | None = None,
                         segment_ids: Tensor | None = None) -> TokenInputs:
    """Check [B, T] shapes/dtypes and flatten; advantages may be [B] or [B, T]."""
    b, t = batch_shape
    for name, x in (("targets", targets), ("behaviour_logprobs", behaviour_logprobs), ("mask", mask)):
        if tuple(x.shape) != (b, t):
            raise ValueError(f"{name} must be [B, T] = {(b, t)}, got {tuple(x.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if tuple(advantages.shape) == (b,):
        advantages = advantages[:, None].expand(b, t)
    elif tuple(advantages.shape) != (b, t):
        raise ValueError(f"advantages must be [B] or [B, T] = {(b, t)}, got {tuple(advantages.shape)}")
    if proximal_logprobs is not None and tuple(proximal_logprobs.shape) != (b, t):
        raise ValueError(f"proximal_logprobs must be [B, T], got {tuple(proximal_logprobs.shape)}")
    if kl is not None:
        for name, x in (("kl.ref_logprobs", kl.ref_logprobs), ("kl.segment_ids", kl.segment_ids)):
            if tuple(x.shape) != (b, t):
                raise ValueError(f"{name} must be [B, T] = {(b, t)}, got {tuple(x.shape)}")
        kl = SequenceKL(kl.ref_logprobs.reshape(-1).detach(), _flat_segments(kl.segment_ids), float(kl.weight),
                        n_segments=kl.n_segments if b == 1 else None)  # one row: flat ids = the row's ids
    if segment_ids is not None and tuple(segment_ids.shape) != (b, t):
        raise ValueError(f"segment_ids must be [B, T] = {(b, t)}, got {tuple(segment_ids.shape)}")
    return TokenInputs(
        targets=targets.reshape(-1).to(torch.int64).contiguous(),
        behaviour=behaviour_logprobs.reshape(-1).detach(),
        advantages=advantages.reshape(-1).detach(),
        mask=mask.reshape(-1).bool(),
        proximal=None if proximal_logprobs is None else proximal_logprobs.reshape(-1).detach(),
        shape=(b, t),
        kl=kl,
        segments=None if segment_ids is None else _flat_segments(segment_ids),
    )


def _flat_segments(segment_ids: Tensor) -> Tensor:
    """[B, T] per-row sequence ids -> [N] ids in one space over all rows (a sequence never spans two rows)."""
    b = segment_ids.shape[0]
    if b == 1:  # no other row to offset from: skip reading max() back from the device (a host sync)
        return segment_ids.to(torch.int64).reshape(-1)
    width = int(segment_ids.max()) + 1 if segment_ids.numel() else 0
    seg = segment_ids.to(torch.int64) + (torch.arange(b, device=segment_ids.device) * width)[:, None]
    return seg.reshape(-1)


def check_targets(tok: TokenInputs, vocab_size: int) -> None:
    """Unmasked targets must lie in the (global) vocabulary; skipped on CUDA to avoid a host sync."""
    if tok.targets.is_cuda:
        return
    used = tok.targets[tok.mask]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= vocab_size):
        raise ValueError(f"unmasked targets must be in [0, {vocab_size}), got range "
                         f"[{int(used.min())}, {int(used.max())}]")


def resolve_normalizer(mask: Tensor, normalizer) -> Tensor | float:
    """The reference's default (mask.sum() of the call, at least 1), fixed once so chunks agree."""
    if normalizer is None:
        return mask.sum().clamp_min(1).to(torch.float32)
    return normalizer


def reduce_stats(row_max: Tensor, row_sum: Tensor, target_logit: Tensor, shard: VocabShard):
    """(lse, target_logit) over the full vocabulary. Under TP: one MAX all-reduce of the row maxima,
    one SUM all-reduce of [rescaled sum-exp; target logit] (only the owning rank has it non-zero)."""
    if shard.group is not None:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=shard.group)
        packed = torch.stack([row_sum * torch.exp(row_max - global_max), target_logit])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=shard.group)
        row_max, row_sum, target_logit = global_max, packed[0], packed[1]
    return row_max + torch.log(row_sum), target_logit


def loss_and_coef(logp: Tensor, tok: TokenInputs, sl: slice, eps_low: float, eps_high: float,
                  normalizer, correction: ISCorrection, need_coef: bool):
    """Reference loss of tokens `sl` (token-level, with the minibatch normaliser) and d loss/d logp.
    A sequence-level correction needs whole sequences: `sl` must then cover every token (no chunking)."""
    lp = logp.detach().requires_grad_(need_coef)
    if correction.kind == "sequence_tis" and sl != slice(None):
        raise ValueError("is_correction: sequence_tis needs whole sequences, not token chunks")
    with torch.enable_grad():
        loss = clipped_token_loss(
            lp[None], tok.behaviour[sl][None], tok.advantages[sl][None], tok.mask[sl][None],
            eps_low, eps_high, normalizer=normalizer,
            proximal_logprobs=None if tok.proximal is None else tok.proximal[sl][None],
            correction=correction, segment_ids=None if tok.segments is None else tok.segments[sl][None],
        )
        if tok.kl is not None:
            n_segments = tok.kl.n_segments if sl == slice(None) else None  # a chunk may lack the last ones
            loss = loss + tok.kl.weight * kl_k2_segment_sum(lp, tok.kl.ref_logprobs[sl], tok.mask[sl],
                                                            tok.kl.segment_ids[sl], n_segments)
        coef = torch.autograd.grad(loss, lp)[0] if need_coef else None
    return loss.detach(), coef
