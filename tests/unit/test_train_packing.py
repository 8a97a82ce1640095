"""Packing: bin validity, optimality against exact enumeration, row layout, masks, statistics."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from megatron_rl.records import TrainSequence
from megatron_rl.train.packing import first_fit_decreasing, pack_sequences, split_balanced


def _seq(n_prompt: int, n_completion: int, start: int = 1, adv: float = 1.0) -> TrainSequence:
    ids = list(range(start, start + n_prompt + n_completion))
    return TrainSequence(token_ids=ids, prompt_len=n_prompt,
                         behaviour_logprobs=[-0.01 * (k + 1) for k in range(n_completion)], advantage=adv)


def _optimal_bins(lengths: list[int], capacity: int) -> int:
    """Exact minimum number of bins by enumerating assignments (tiny inputs only)."""
    n = len(lengths)
    for k in range(1, n + 1):
        for assign in itertools.product(range(k), repeat=n):
            loads = [0] * k
            for i, b in enumerate(assign):
                loads[b] += lengths[i]
            if max(loads) <= capacity:
                return k
    return n


def test_ffd_bins_are_valid_and_near_optimal():
    rng = random.Random(0)
    for _ in range(40):
        cap = rng.randint(10, 30)
        lengths = [rng.randint(1, cap) for _ in range(rng.randint(1, 7))]
        bins = first_fit_decreasing(lengths, cap)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= cap for b in bins)
        # FFD's known bound: <= 11/9 OPT + 6/9
        opt = _optimal_bins(lengths, cap)
        assert len(bins) <= 11 / 9 * opt + 6 / 9


def test_ffd_packs_a_known_case_tightly():
    # first-fit in input order needs 5 bins ([3,3,3] [3,7] [7] [7] [7]); decreasing order finds 4
    lengths = [3, 3, 3, 3, 7, 7, 7, 7]
    bins = first_fit_decreasing(lengths, 10)
    assert len(bins) == 4
    assert all(sorted(lengths[i] for i in b) == [3, 7] for b in bins)


def test_ffd_rejects_oversized_and_empty():
    with pytest.raises(ValueError, match="more than the micro-batch capacity"):
        first_fit_decreasing([5, 11], 10)
    with pytest.raises(ValueError, match="length 0"):
        first_fit_decreasing([0], 10)


def test_split_balanced_covers_and_balances():
    lengths = [9, 1, 8, 2, 7, 3]
    shares = split_balanced(lengths, 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert loads == [15, 15]
    with pytest.raises(ValueError, match="at least one sequence"):
        split_balanced([3], 2)


def test_row_layout_labels_masks_and_values():
    seqs = [_seq(2, 3, start=10, adv=0.5), _seq(3, 1, start=40, adv=-2.0)]
    packed = pack_sequences(seqs, capacity=16)
    assert len(packed.micro_batches) == 1
    mb = packed.micro_batches[0]
    assert mb.tokens[0].tolist() == seqs[0].token_ids + seqs[1].token_ids
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    # seq 0: completion tokens at 2,3,4 -> predicted at positions 1,2,3
    # seq 1 (offset 5): completion token at 3 -> predicted at position 5+2
    assert mb.loss_mask[0].tolist() == [0, 1, 1, 1, 0, 0, 0, 1, 0]
    for pos in (1, 2, 3, 7):
        assert mb.labels[0, pos] == mb.tokens[0, pos + 1]
    assert mb.behaviour_logprobs[0, [1, 2, 3, 7]].tolist() == pytest.approx([-0.01, -0.02, -0.03, -0.01])
    assert mb.advantages[0, [1, 2, 3, 7]].tolist() == [0.5, 0.5, 0.5, -2.0]
    assert mb.cu_seqlens.tolist() == [0, 5, 9]
    assert mb.n_loss_tokens == sum(s.completion_len for s in seqs)


def test_an_episodes_environment_tokens_carry_no_loss_logprob_advantage_or_version():
    """A two-turn episode (records.TrainSequence.loss_mask): its environment tokens are context only."""
    ep = TrainSequence(token_ids=list(range(10, 18)), prompt_len=2, behaviour_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
                       advantage=0.5, weight_versions=[3, 3, -1, -1, 4, 4], loss_mask=[1, 1, 0, 0, 1, 1])
    mb = pack_sequences([ep, _seq(1, 2, start=40, adv=-1.0)], capacity=16).micro_batches[0]
    # completion tokens at 2..7 are predicted at positions 1..6; the environment's (4, 5) at 3, 4
    assert mb.loss_mask[0].tolist()[:8] == [0, 1, 1, 0, 0, 1, 1, 0]
    assert mb.advantages[0, :8].tolist() == [0, 0.5, 0.5, 0, 0, 0.5, 0.5, 0]
    assert mb.behaviour_logprobs[0, :8].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, -0.3, -0.4, 0])
    assert mb.weight_versions[0, :8].tolist() == [-1, 3, 3, -1, -1, 4, 4, -1]
    assert mb.tokens[0, :8].tolist() == ep.token_ids  # environment tokens stay in the context
    assert mb.n_loss_tokens == ep.n_loss_tokens + 2 == 6
    with pytest.raises(ValueError, match="loss mask of 5"):
        TrainSequence(list(range(8)), 2, [0.0] * 6, 1.0, loss_mask=[1] * 5)
    with pytest.raises(ValueError, match="no model-sampled"):
        TrainSequence(list(range(8)), 2, [0.0] * 6, 1.0, loss_mask=[0] * 6)


def test_attention_mask_is_block_diagonal_causal_with_padding_segment():
    seqs = [_seq(1, 2), _seq(2, 1)]
    mb = pack_sequences(seqs, capacity=16, pad_multiple=8).micro_batches[0]
    assert mb.length == 8 and mb.n_real_tokens == 6
    mask = mb.attention_mask()[0, 0]
    seg = [0, 0, 0, 1, 1, 1, 2, 2]
    for i in range(8):
        for j in range(8):
            allowed = seg[i] == seg[j] and j <= i
            assert bool(mask[i, j]) == (not allowed), (i, j)
    assert mb.loss_mask[0, 6:].sum() == 0 and mb.cu_seqlens.tolist() == [0, 3, 6, 8]


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half) / half))
    ang = pos[:, None].float() * freqs[None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)


def test_packed_attention_equals_separate_sequences():
    """A causal RoPE attention over the packed row with the packed mask equals per-sequence runs."""
    torch.manual_seed(0)
    seqs = [_seq(3, 4), _seq(2, 2), _seq(1, 5)]
    mb = pack_sequences(seqs, capacity=64).micro_batches[0]
    d = 8
    emb = torch.randn(200, d)
    wq, wk, wv = (torch.randn(d, d) for _ in range(3))

    def attend(ids, pos, allowed):
        h = emb[ids]
        q, k, v = _rope(h @ wq, pos), _rope(h @ wk, pos), h @ wv
        return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed)[0]

    packed = attend(mb.tokens[0], mb.position_ids[0], ~mb.attention_mask()[0, 0])
    for j, s in enumerate(seqs):
        n = len(s.token_ids)
        ref = attend(torch.tensor(s.token_ids), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
        a, b = int(mb.cu_seqlens[j]), int(mb.cu_seqlens[j + 1])
        torch.testing.assert_close(packed[a:b], ref, rtol=1e-5, atol=1e-5)


def test_stats_padding_fraction_vs_naive():
    seqs = [_seq(2, 8), _seq(2, 2), _seq(1, 3), _seq(1, 1)]  # lengths 10, 4, 4, 2
    packed = pack_sequences(seqs, capacity=10)
    st = packed.stats
    assert st.real_tokens == 20 and st.naive_tokens == 40 and st.n_bins == 2
    assert st.packed_tokens == 20 and st.padding_fraction == 0.0
    assert st.naive_padding_fraction == pytest.approx(0.5)
    common = pack_sequences(seqs, capacity=10, pad_to_common=True)
    assert [m.length for m in common.micro_batches] == [10, 10] and common.stats.padding_fraction == 0.0
    padded = pack_sequences(seqs, capacity=10, pad_multiple=4)  # bins of 10 -> 12
    assert padded.stats.packed_tokens == 24 and padded.stats.padding_fraction == pytest.approx(4 / 24)


def test_every_token_lands_once_in_order():
    rng = random.Random(1)
    seqs = [_seq(rng.randint(1, 5), rng.randint(1, 9), start=100 * k) for k in range(12)]
    packed = pack_sequences(seqs, capacity=20, advantages=[float(k) for k in range(12)])
    seen = []
    for mb in packed.micro_batches:
        assert mb.length <= 20
        for j, i in enumerate(mb.seq_indices):
            a, b = int(mb.cu_seqlens[j]), int(mb.cu_seqlens[j + 1])
            assert mb.tokens[0, a:b].tolist() == seqs[i].token_ids
            assert set(mb.advantages[0, a:b][mb.loss_mask[0, a:b] > 0].tolist()) == {float(i)}
            seen.append(i)
    assert sorted(seen) == list(range(12))
    with pytest.raises(ValueError, match="advantages"):
        pack_sequences(seqs, capacity=20, advantages=[0.0])


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_slices_cover_each_segment_in_balanced_chunks(cp):
    """Every segment padded to a multiple of 2*CP; rank r keeps chunks r and 2*CP-1-r of each segment
    (Megatron's load balancing), so the ranks' slices put together are the whole row, each token once."""
    seqs = [_seq(2, 5, start=1), _seq(1, 1, start=40), _seq(3, 8, start=60)]  # 7, 2 (< 2*CP) and 11 tokens
    whole = pack_sequences(seqs, capacity=64, pad_multiple=2, cp=(cp, 0)).micro_batches[0]
    assert whole.cp == (cp, 0)
    cu = whole.cu_seqlens.tolist()
    lengths = [e - a for a, e in zip(cu, cu[1:])]
    assert all(n % (2 * cp) == 0 for n in lengths) and cu[-1] % (2 * cp * 2) == 0
    assert lengths[:3] == [-(-n // (2 * cp)) * 2 * cp for n in (7, 2, 11)]
    # the whole row built by hand: each sequence, its pad tokens (id 0, no loss), then the bin's padding
    tokens, mask = [], []
    for s, n in zip(seqs, lengths):
        k = len(s.token_ids)
        tokens += s.token_ids + [0] * (n - k)
        mask += [0.0] * (s.prompt_len - 1) + [1.0] * s.completion_len + [0.0] * (n - k + 1)
    tokens += [0] * (cu[-1] - len(tokens))
    mask += [0.0] * (cu[-1] - len(mask))
    full = {"tokens": torch.tensor(tokens), "loss_mask": torch.tensor(mask)}
    parts = [pack_sequences(seqs, capacity=64, pad_multiple=2, cp=(cp, r)).micro_batches[0] for r in range(cp)]
    seen = torch.zeros(cu[-1], dtype=torch.long)
    for r, part in enumerate(parts):
        assert part.length * cp == cu[-1] and part.cu_seqlens.tolist() == cu
        expect = []
        for a, n in zip(cu, lengths):
            c = n // (2 * cp)
            expect += list(range(a + r * c, a + (r + 1) * c)) + list(range(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c))
        seen[expect] += 1
        for name in ("tokens", "loss_mask"):
            assert torch.equal(getattr(part, name)[0], full[name][expect]), name
    assert bool((seen == 1).all())
    # the real tokens and their loss positions are those of the unpadded packing
    assert sum(int(p.loss_mask.sum()) for p in parts) == sum(s.completion_len for s in seqs)
    with pytest.raises(ValueError, match="no \\[T, T\\] mask"):
        parts[0].attention_mask()
