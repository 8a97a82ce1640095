"""Per-sequence views of a CP (and TP) rank's outputs, for the context-parallel tests' workers: put a
micro-batch's per-token tensor back in row order over the CP ranks (with `packing.cp_token_index`,
independently of the attention's own bookkeeping), gather vocab-parallel logits over TP, and cut the
rows into sequences merged over every rank (a sequence of a row that shares its prompt: the prefix's
rows, then its own)."""
from __future__ import annotations

import torch


def row_order(local: torch.Tensor, mb) -> torch.Tensor:
    """A micro-batch's per-token tensor ([T_local, ...], this rank's chunks) in row order [T, ...]."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.train.packing import cp_token_index

    if mb.cp is None:
        return local
    cp, group = mb.cp[0], ps.get_context_parallel_group()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    full = local.new_empty((int(mb.cu_seqlens[-1]),) + tuple(local.shape[1:]))
    for r, part in enumerate(parts):
        full[cp_token_index(mb.cu_seqlens, cp, r)] = part
    return full


def full_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Vocab-parallel logits [..., V/TP] -> [..., vocab] (TP ranks' shards side by side, padding cut)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab]


def per_sequence(prepared, rows: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """{index in the minibatch: the sequence's slice of its bin's row}, merged over every rank."""
    import torch.distributed as dist

    mine = {}
    for mb, row in zip(prepared.packed.micro_batches, rows):
        for j, local in enumerate(mb.seq_indices):
            i = prepared.share[local]
            mine[i] = row[sequence_rows(mb, j, len(prepared.seqs[i].token_ids))].float().cpu()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def sequence_rows(mb, j: int, length: int) -> torch.Tensor:
    """The rows of a packed micro-batch (in row order, over every CP rank) that hold sequence `j` of the
    bin, `length` tokens in token order: segment j of an unshared row; of a row sharing prompts
    (trainer.share_prompts; never under CP), the sequence's branch after its prefix segment."""
    cu = mb.cu_seqlens.tolist()
    if mb.segment_parents is None:
        return torch.arange(cu[j], cu[j] + length)
    own = torch.nonzero(mb.segment_ids.flatten() == j).flatten()
    segment = next(s for s in range(len(cu) - 1) if cu[s] <= int(own[0]) < cu[s + 1])
    parent = mb.segment_parents[segment]
    return own if parent < 0 else torch.cat([torch.arange(cu[parent], cu[parent + 1]), own])
