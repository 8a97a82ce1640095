"""Shared prompts (trainer.share_prompts): a packed row holds a group's prompt once and each sample's
completion as a branch after it. Checked against independent references: every loss position sees
exactly its own sequence's tokens at their own positions (read back off the row's structure); the
attention of a shared row equals the attention of the unshared rows (plain and with a sliding window);
the step's loss, metrics and gradients equal the HF per-sequence reference and the unshared packing,
while the model computes each shared prompt once."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.records import RoutedExperts, TrainSequence
from megatron_rl.train.packing import deal_to_ranks, pack_sequences, split_balanced
from support.tolerances import network_error, transformer_matmuls
from unit.test_train_attention import GROUPS, HEAD_DIM, HEADS, _config, _modules, _run
from unit.test_train_step import SAME_LAYOUT, hf_completion_logprobs, hf_model, make_config, reference


def _groups(spec, vocab=300, seed=0) -> list[TrainSequence]:
    """spec: (prompt_len, [completion lengths]) per group; each group's samples share its prompt. Group
    members are interleaved with the other groups' (the packer finds them anyway)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi, (p, completions) in enumerate(spec):
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        groups.append([TrainSequence(prompt + torch.randint(3, vocab, (c,), generator=g).tolist(), p,
                                     (-torch.rand(c, generator=g)).tolist(), float(torch.randn((), generator=g)),
                                     weight_versions=[gi] * c, group_id=f"g{gi}") for c in completions])
    out = []
    for i in range(max(len(x) for x in groups)):
        out += [x[i] for x in groups if i < len(x)]
    return out


def _context_of(mb, row: int) -> tuple[list[int], list[int]]:
    """The tokens and positions that position `row` attends to, read off the row's segments and parents."""
    cu = mb.cu_seqlens.tolist()
    parents = mb.segment_parents or (-1,) * (len(cu) - 1)
    seg = next(i for i in range(len(cu) - 1) if cu[i] <= row < cu[i + 1])
    rows = list(range(cu[seg], row + 1))
    if parents[seg] >= 0:
        rows = list(range(cu[parents[seg]], cu[parents[seg] + 1])) + rows
    return [int(mb.tokens[0, r]) for r in rows], [int(mb.position_ids[0, r]) for r in rows]


def _check_rows(seqs, batch):
    """Every sequence's loss labels sit where its context is exactly its own prefix at its positions."""
    seen = set()
    for mb in batch.micro_batches:
        for row in torch.nonzero(mb.loss_mask[0] > 0).flatten().tolist():
            s = seqs[mb.seq_indices[int(mb.segment_ids[row])]]
            tokens, positions = _context_of(mb, row)
            k = len(tokens)  # the label is token k of the sequence
            assert tokens == s.token_ids[:k] and positions == list(range(k))
            assert int(mb.labels[0, row]) == s.token_ids[k]
            j = k - s.prompt_len
            assert float(mb.behaviour_logprobs[0, row]) == pytest.approx(s.behaviour_logprobs[j])
            assert int(mb.weight_versions[0, row]) == s.weight_versions[j]
            seen.add((id(s), k))
    assert seen == {(id(s), k) for s in seqs for k in range(s.prompt_len, len(s.token_ids))}


def test_packing_holds_each_prompt_once_and_every_label_sees_its_own_sequence():
    seqs = _groups([(6, [3, 5, 2, 4]), (4, [7, 1, 3]), (1, [4, 2]), (9, [3])])
    shared = pack_sequences(seqs, capacity=64, share_prompts=True)
    plain = pack_sequences(seqs, capacity=64)
    _check_rows(seqs, shared)
    _check_rows(seqs, plain)
    # prompts of 6 and 4 tokens: all but the last prompt token held once per group; a 1-token prompt and a
    # lone sequence share nothing
    assert shared.stats.shared_tokens == 5 * 3 + 3 * 2
    assert shared.micro_batches[0].n_real_tokens == sum(len(s.token_ids) for s in seqs) - 21
    assert plain.stats.shared_tokens == 0 and plain.micro_batches[0].segment_parents is None
    assert shared.stats.padding_fraction == plain.stats.padding_fraction == 0.0


def test_a_group_larger_than_a_bin_is_cut_each_part_with_its_prompt():
    seqs = _groups([(8, [6, 6, 6, 6, 6])])  # 7 + 5 * 7 = 42 tokens shared
    batch = pack_sequences(seqs, capacity=24, share_prompts=True)
    _check_rows(seqs, batch)
    assert all(mb.length <= 24 for mb in batch.micro_batches)
    assert len(batch.micro_batches) == 3  # 7 + 2*7 = 21 per part of two, the fifth sample alone
    assert batch.stats.shared_tokens == 7 * 2


def test_sequences_with_routes_are_not_shared_and_cp_refuses():
    seqs = _groups([(5, [3, 3, 6])])
    seqs[1].routed_experts = RoutedExperts(bytes(len(seqs[1].token_ids) - 1), layers=1, topk=1)
    batch = pack_sequences(seqs, capacity=64, share_prompts=True)
    _check_rows(seqs, batch)
    assert batch.stats.shared_tokens == 4  # the other two share; the routed one carries its own prompt
    with pytest.raises(ValueError, match="context parallelism"):
        pack_sequences(seqs, capacity=64, share_prompts=True, cp=(2, 0))
    with pytest.raises(ValueError, match="sequence 2 has 11 tokens"):  # named by its index in the input
        pack_sequences(seqs, capacity=10, share_prompts=True)
    with pytest.raises(ValueError, match="no block-diagonal mask"):
        batch.micro_batches[0].attention_mask()


def _computed(seqs, share) -> int:
    """Tokens computed for a rank's share: each distinct prompt (before its last token) once, by hand."""
    prompts = {tuple(seqs[i].token_ids[:seqs[i].prompt_len - 1]) for i in share}
    return sum(map(len, prompts)) + sum(len(seqs[i].token_ids) - seqs[i].prompt_len + 1 for i in share)


def test_data_parallel_ranks_get_whole_groups_when_that_is_no_slower():
    seqs = _groups([(30, [4, 6, 5]), (28, [3, 7, 2]), (25, [5, 5, 4]), (26, [6, 2, 3])])
    shares = deal_to_ranks(seqs, 2, share_prompts=True)
    assert sorted(i for s in shares for i in s) == list(range(len(seqs)))
    by_group = {s.group_id: {r for r, share in enumerate(shares) if i in share} for i, s in enumerate(seqs)}
    assert all(len(ranks) == 1 for ranks in by_group.values())  # no prompt computed on two ranks
    # the busiest rank computes fewer tokens than with single sequences dealt (each rank then computes
    # nearly every prompt), and no more than the best whole-group dealing found by enumeration
    alone = split_balanced([len(s.token_ids) for s in seqs], 2)
    assert shares != alone and max(_computed(seqs, s) for s in shares) < max(_computed(seqs, s) for s in alone)
    names = sorted(by_group)
    best = min(max(_computed(seqs, [i for i, s in enumerate(seqs) if (s.group_id in side) == r]) for r in (0, 1))
               for mask in range(1, 2 ** len(names) - 1)
               for side in [{n for k, n in enumerate(names) if mask >> k & 1}])
    assert max(_computed(seqs, s) for s in shares) == best
    # without sharing, fewer groups than ranks, or one group far longer than the rest: single sequences
    assert deal_to_ranks(seqs, 2, share_prompts=False) == alone
    assert deal_to_ranks(seqs, 5, share_prompts=True) == split_balanced([len(s.token_ids) for s in seqs], 5)
    lopsided = _groups([(4, [60, 50, 55]), (4, [2, 3])])
    assert deal_to_ranks(lopsided, 2, share_prompts=True) == split_balanced([len(s.token_ids) for s in lopsided], 2)


@pytest.mark.parametrize("window", [None, 2])
def test_attention_of_a_shared_row_equals_the_unshared_rows(tp1, window):
    """q/k/v of a prompt are the same in every sample (same tokens, same positions): the shared row's
    outputs and gradients equal those of [prompt, branch] rows attended one after the other."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.train.attention import SegmentCausalAttention, SharedPrefixSeqParams

    config = _config(window=None if window is None else (window, 0))
    module = SegmentCausalAttention(config, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(3)
    prefix, branches, lone = 5, [4, 1, 6], 3

    def qkv(n):
        return [torch.randn(n, 1, h, HEAD_DIM, generator=g) for h in (HEADS, GROUPS, GROUPS)]

    pre, parts, alone = qkv(prefix), [qkv(n) for n in branches], qkv(lone)
    shared_in = [torch.cat([pre[i]] + [b[i] for b in parts] + [alone[i]]) for i in range(3)]
    plain_in = [torch.cat([t for b in parts for t in (pre[i], b[i])] + [alone[i]]) for i in range(3)]
    cu_shared = torch.tensor([0, prefix] + [prefix + sum(branches[:j + 1]) for j in range(3)]
                             + [prefix + sum(branches) + lone], dtype=torch.int32)
    plain_lengths = [prefix + n for n in branches] + [lone]
    cu_plain = torch.tensor([0] + torch.tensor(plain_lengths).cumsum(0).tolist(), dtype=torch.int32)
    shared_p = SharedPrefixSeqParams(qkv_format="thd", cu_seqlens_q=cu_shared, cu_seqlens_kv=cu_shared,
                                     max_seqlen_q=11, max_seqlen_kv=11, segment_parents=(-1, 0, 0, 0, -1))
    plain_p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_plain, cu_seqlens_kv=cu_plain,
                              max_seqlen_q=11, max_seqlen_kv=11)
    w = torch.randn(int(cu_plain[-1]), 1, HEADS * HEAD_DIM, generator=g)
    # the same weight on a token wherever it sits: the prefix's in the shared row is the sum over samples
    idx = []  # plain row index -> shared row index
    for j, n in enumerate(branches):
        idx += list(range(prefix)) + list(range(int(cu_shared[j + 1]), int(cu_shared[j + 2])))
    idx += list(range(int(cu_shared[-2]), int(cu_shared[-1])))
    idx = torch.tensor(idx)
    w_shared = torch.zeros(int(cu_shared[-1]), 1, HEADS * HEAD_DIM).index_add_(0, idx, w)
    out_p, grads_p = _run(module, plain_in, w, thd=True, packed_seq_params=plain_p)
    out_s, grads_s = _run(module, shared_in, w_shared, thd=True, packed_seq_params=shared_p)
    torch.testing.assert_close(out_s.reshape(-1, HEADS * HEAD_DIM)[idx], out_p.reshape(-1, HEADS * HEAD_DIM),
                               rtol=1e-5, atol=1e-6)
    for gs, gp in zip(grads_s, grads_p):  # the prompt's gradient: the sum of its copies'
        want = torch.zeros_like(gs).index_add_(0, idx, gp)
        torch.testing.assert_close(gs, want, rtol=1e-5, atol=1e-5)


def test_step_with_shared_prompts_equals_hf_and_unshared(tiny_llama_dir):
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    seqs = _groups([(6, [9, 11, 8, 10]), (3, [6, 2, 4]), (2, [5])], vocab=hf.config.vocab_size)
    with torch.no_grad():  # behaviour = HF logprobs + noise: ratios on both sides of the clip
        g = torch.Generator().manual_seed(1)
        for s in seqs:
            lp = hf_completion_logprobs(hf, s)
            s.behaviour_logprobs = (lp + 0.4 * torch.randn(len(lp), generator=g)).tolist()
    ref, ref_grads = reference(hf, seqs)
    # 40 tokens per bin: the first group (5 shared + branches of 10, 12, 9, 11) is cut after its third sample
    # (5 + 31 tokens), the fourth then alone; the second group's 2 shared tokens serve its three samples
    trainer = Trainer(make_config(tiny_llama_dir, micro_batch_tokens=40))
    assert trainer.ctx.trainer.share_prompts  # the default
    runs = {}
    for share in (True, False):
        ctx = dataclasses.replace(trainer.ctx, trainer=dataclasses.replace(trainer.ctx.trainer, share_prompts=share))
        trainer.optimizer.zero_grad()
        seen = []  # tokens the model computes, per forward
        hook = trainer.model_chunks[0].embedding.register_forward_hook(
            lambda _, a, out: seen.append(out.shape[0] * out.shape[1]))
        out = forward_backward(trainer.model, seqs, ctx)
        hook.remove()
        grads = {n: p.main_grad.clone() for n, p in trainer.model_chunks[0].named_parameters()}
        runs[share] = (out, sum(seen), grads)
    (shared, shared_tokens, shared_grads), (plain, plain_tokens, plain_grads) = runs[True], runs[False]
    assert shared.stats.shared_tokens == 5 * 2 + 2 * 2 and plain.stats.shared_tokens == 0
    assert shared.metrics["shared_prompt_fraction"] == pytest.approx(14 / sum(len(s.token_ids) for s in seqs))
    assert plain.metrics["shared_prompt_fraction"] == 0.0
    assert shared_tokens == shared.stats.packed_tokens < plain_tokens == plain.stats.packed_tokens
    rtol = network_error(transformer_matmuls(2), 384)
    for key in ("loss", "ratio_mean", "ratio_min", "ratio_max", "entropy", "logprob_mean", "n_loss_tokens"):
        assert shared.metrics[key] == pytest.approx(ref[key], rel=rtol, abs=rtol * 1e-1), key
        assert shared.metrics[key] == pytest.approx(plain.metrics[key], rel=rtol, abs=rtol * 1e-1), key
    for key in ("clip_frac_low", "clip_frac_high"):
        assert shared.metrics[key] == pytest.approx(ref[key], abs=1e-9), key
    for meg, hf_name in SAME_LAYOUT.items():
        torch.testing.assert_close(shared_grads[meg], ref_grads[hf_name], rtol=rtol, atol=rtol * 1e-2)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=rtol, atol=rtol * 1e-2, msg=lambda m: f"{name}: {m}")
