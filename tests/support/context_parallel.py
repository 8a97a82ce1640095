"""Per-sequence views of a CP (and TP) rank's outputs, for the context-parallel tests' workers: put a
micro-batch's per-token tensor back in row order over the CP ranks (with `packing.cp_token_index`,
independently of the attention's own bookkeeping), gather vocab-parallel logits over TP, and cut the
rows into sequences merged over every rank."""
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
        cu = mb.cu_seqlens.tolist()
        for j, local in enumerate(mb.seq_indices):
            i = prepared.share[local]
            mine[i] = row[cu[j]:cu[j] + len(prepared.seqs[i].token_ids)].float().cpu()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}
