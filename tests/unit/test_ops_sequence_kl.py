"""SequenceKL's host-known segment count (no read-back of max(segment_ids) from the device) gives the
fused loss bit for bit the value and gradient of the path that reads it; the packer's count is that
maximum + 1 on every micro-batch, CP slices and empty expert-parallel bins included."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algo.kl import kl_k2_segment_sum
from megatron_rl.ops import SequenceKL, fused_clipped_loss
from megatron_rl.ops._core import _flat_segments
from megatron_rl.records import TrainSequence
from megatron_rl.train.packing import pack_sequences


def _packed_row_ids(g: torch.Generator, t: int) -> torch.Tensor:
    """[1, T] ids of a packed row: consecutive segments 0..k-1 of random lengths."""
    cuts = sorted(torch.randperm(t - 1, generator=g)[: int(torch.randint(0, min(6, t - 1), (1,), generator=g))] + 1)
    ids = torch.zeros(t, dtype=torch.long)
    for c in cuts:
        ids[int(c):] += 1
    return ids[None]


def _loss_and_grad(logits, targets, behaviour, adv, mask, kl):
    x = logits.clone().requires_grad_(True)
    loss, logp = fused_clipped_loss(x, targets, behaviour, adv, mask, normalizer=1.0, kl=kl, return_logprobs=True)
    loss.backward()
    return loss.detach(), logp, x.grad


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_with_the_host_count_is_bit_identical_to_reading_it(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    t, v = int(torch.randint(8, 80, (1,), generator=g)), 53
    logits = (torch.randn(1, t, v, generator=g) * 2).to(dtype)
    targets = torch.randint(0, v, (1, t), generator=g)
    behaviour = -torch.rand(1, t, generator=g) * 4
    adv = torch.randn(1, t, generator=g)
    mask = torch.rand(1, t, generator=g) > 0.3
    ref_logprobs = -torch.rand(1, t, generator=g) * 4
    ids = _packed_row_ids(g, t)
    n = int(ids.max()) + 1
    read = _loss_and_grad(logits, targets, behaviour, adv, mask, SequenceKL(ref_logprobs, ids, 0.37))
    known = _loss_and_grad(logits, targets, behaviour, adv, mask, SequenceKL(ref_logprobs, ids, 0.37, n_segments=n))
    for a, b in zip(read, known):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_k2_segment_sum_with_the_count_given_is_bit_identical():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        t = int(torch.randint(2, 300, (1,), generator=g))
        ids = _packed_row_ids(g, t)[0]
        logp = (-torch.rand(t, generator=g) * 5).requires_grad_(True)
        ref, mask = -torch.rand(t, generator=g) * 5, torch.rand(t, generator=g) > 0.2
        read = kl_k2_segment_sum(logp, ref, mask, ids)
        (grad_read,) = torch.autograd.grad(read, logp)
        known = kl_k2_segment_sum(logp, ref, mask, ids, n_segments=int(ids.max()) + 1)
        (grad_known,) = torch.autograd.grad(known, logp)
        assert torch.equal(read, known) and torch.equal(grad_read, grad_known)


def test_one_row_flattens_to_its_own_ids_as_the_offset_rule_gives():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.int64, torch.int32):
        ids = _packed_row_ids(g, 40).to(dtype)
        offset_rule = ids.to(torch.int64) + (torch.arange(1) * (int(ids.max()) + 1))[:, None]
        flat = _flat_segments(ids)
        assert flat.dtype == torch.int64 and torch.equal(flat, offset_rule.reshape(-1))
    rows = torch.tensor([[0, 0, 1, 2], [0, 1, 1, 1]])  # several rows still get disjoint id ranges
    assert _flat_segments(rows).tolist() == [0, 0, 1, 2, 3, 4, 4, 4]


@pytest.mark.parametrize("cp", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_the_packers_segment_count_is_max_id_plus_one(cp):
    g = torch.Generator().manual_seed(cp[0] * 7 + cp[1])
    seqs = []
    for _ in range(9):
        n = int(torch.randint(3, 30, (1,), generator=g))
        seqs.append(TrainSequence(list(range(1, n + 1)), 2, [0.0] * (n - 2), advantage=1.0))
    batch = pack_sequences(seqs, capacity=64, cp=cp, pad_to_common=True, min_bins=6)
    for mb in batch.micro_batches:
        assert len(mb.cu_seqlens) - 1 == int(mb.segment_ids.max()) + 1
