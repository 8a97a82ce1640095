"""Pack RL sequences into token-bounded micro-batches (no padding to the longest sequence).

Each bin of at most `capacity` tokens becomes one micro-batch: the sequences are concatenated into
one row with per-sequence position ids and a block-diagonal causal attention mask (the local layer
spec on CPU takes it explicitly; Transformer Engine on GPU takes `PackedSeqParams` in THD format
built from the same boundaries). Bins are filled first-fit decreasing.
Packing builds its tensors on the CPU (cheap, device-agnostic); the step moves each micro-batch to the
model's device once with `PackedMicroBatch.to` before any forward reads it.

Context parallel (`cp=(CP, rank)`): each sequence's segment is padded to a multiple of 2*CP (trailing
pad tokens of its own segment, no loss: causal attention keeps them out of the real tokens), and
`PackedMicroBatch.cp_slice` keeps chunks r and 2*CP-1-r of every segment for rank r, in segment
order: Megatron's load balancing, the THD partitioning that Transformer Engine's CP attention and
Megatron's THD RoPE expect (`cu_seqlens` stay those of the whole row).

Label alignment: the logit at position t predicts token t+1, so a completion token at index k of
its sequence (k >= prompt_len) is scored at position k-1. `loss_mask` marks those positions (of an
episode, only its model-sampled tokens: `TrainSequence.loss_mask`; environment tokens are context
and carry no loss, no behaviour logprob and no version); `behaviour_logprobs` and `advantages` are
placed there as well. The last token of each sequence
predicts nothing inside the bin (its label is masked), so sequences never leak into each other.

Shared prompts (`share_prompts=True`): sequences of a bin whose tokens before their last prompt
token are the same (a group's samples of one prompt) hold that prefix once: the row is [prefix]
[branch 1] ... [branch k], each branch a sequence's tokens from its last prompt token on, with
positions continuing the prefix's. `segment_parents` then says, per segment of `cu_seqlens`, the
prefix segment it continues (-1: none): a branch attends to its prefix and causally to itself
(train.attention), its RoPE positions are `position_ids` (train.packed_rope), and every loss position
lies in a branch, so the prefix's gradient sums its branches' exactly as the unshared rows' would.
Not with CP, nor for sequences with routed experts (their prompt routes may differ per sample).

Routing replay: `routed_experts` ([layers, topk, T], T last so that `cp_slice` keeps each rank's
tokens) holds each sequence's `TrainSequence.routed_experts` at its own positions; -1 where the
router routes by itself (each sequence's last token, padding, sequences without routes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from megatron_rl.algo.mismatch import mixed_context
from megatron_rl.records import RoutedExperts, TrainSequence


def check_fits(lengths: Sequence[int], capacity: int) -> None:
    """ValueError naming the first sequence that no bin of `capacity` tokens can hold."""
    if capacity < 1:
        raise ValueError(f"bin capacity must be >= 1, got {capacity}")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; lengths must be >= 1")
        if n > capacity:
            raise ValueError(f"sequence {i} has {n} tokens, more than the micro-batch capacity "
                             f"{capacity} (raise trainer.micro_batch_tokens or cap generation length)")


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins whose sums are <= capacity (first-fit decreasing).

    Ties keep input order so the result is deterministic on every rank.
    """
    check_fits(lengths, capacity)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def split_balanced(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Deal indices to `parts` shares balancing token counts (longest first, to the lightest share).

    Used to split a minibatch across data-parallel ranks; every share is non-empty.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(lengths) < parts:
        raise ValueError(f"{len(lengths)} sequences cannot be split over {parts} data-parallel ranks "
                         "(each rank needs at least one sequence per minibatch)")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shares: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in order:
        # lightest share; among equals the one with fewer sequences, then the lowest index
        r = min(range(parts), key=lambda p: (load[p], len(shares[p]), p))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


@dataclass
class PackedMicroBatch:
    """One packed row: all tensors `[1, T]` (T = bin length after padding)."""

    tokens: torch.Tensor  # long
    position_ids: torch.Tensor  # long, restart at 0 for each sequence
    labels: torch.Tensor  # long, next token (0 where loss_mask is 0)
    loss_mask: torch.Tensor  # float32, 1 at positions whose label is a model-sampled completion token
    behaviour_logprobs: torch.Tensor  # float32, aligned with labels
    advantages: torch.Tensor  # float32, aligned with labels
    segment_ids: torch.Tensor  # long [T]: index of the sequence in the bin; padding is its own segment
    cu_seqlens: torch.Tensor  # int32 [n_segments + 1] boundaries (padding included as a segment)
    seq_indices: list[int]  # indices of the packed sequences in the caller's list
    n_real_tokens: int  # tokens of real sequences (excluding padding)
    # float32 [1, T]: sampling temperature of each position's sequence (None: every sequence at 1)
    temperature: torch.Tensor | None = None
    # Filled on the last pipeline stage by the logprob passes of an update (train.update), aligned with
    # labels: the trainer's logprobs of the weights at the update start, the reference policy's, and the
    # distillation teacher's.
    proximal_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    # long [1, T]: weight version that sampled each label (-1: not a completion token, or unknown)
    weight_versions: torch.Tensor | None = None
    # bool [1, T]: the label's turn has earlier model tokens of another version (algo.mismatch.mixed_context)
    mixed_context: torch.Tensor | None = None
    # (CP size, CP rank) once `cp_slice` kept this rank's chunks: tensors hold T / CP tokens, while
    # cu_seqlens still describe the whole row
    cp: tuple[int, int] | None = None
    # bool [1, T], True at padding (bin tail, CP segment tails): Megatron's MoE `padding_mask`, so the
    # router load-balancing loss counts real tokens only
    pad_mask: torch.Tensor | None = None
    # int16 [layers, topk, T]: the generator's expert ids per position (routing replay; -1: the router's
    # own choice); None: no sequence of the bin has routes
    routed_experts: torch.Tensor | None = None
    # per segment of cu_seqlens: the index of the prefix segment it continues, -1 for none; None: the row
    # is block-diagonal causal (no shared prompt)
    segment_parents: tuple[int, ...] | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, device: torch.device | str) -> "PackedMicroBatch":
        """A copy whose tensors (optional ones included) live on `device`; `self` when they already do."""
        device = torch.device(device)
        if self.tokens.device == device:
            return self
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)

    def set_advantages(self, values: Sequence[float]) -> None:
        """Replace the advantages with `values[i]` for the i-th sequence of the caller's list."""
        real = len(self.seq_indices)
        # built where the micro-batch lives: it is indexed by segment_ids and mixed with loss_mask
        per_segment = torch.tensor([float(values[i]) for i in self.seq_indices] + [0.0], dtype=torch.float32,
                                   device=self.segment_ids.device)
        adv = per_segment[self.segment_ids.clamp_max(real)]
        self.advantages = torch.where(self.loss_mask[0] > 0, adv, 0.0).unsqueeze(0)

    def cp_slice(self, cp_size: int, cp_rank: int) -> "PackedMicroBatch":
        """This CP rank's tokens: chunks `cp_rank` and `2*cp_size-1-cp_rank` of each segment, in order."""
        if self.cp is not None:
            raise ValueError("micro-batch already sliced for context parallelism")
        if cp_size == 1:
            return self
        if self.segment_parents is not None:
            raise ValueError("a row with shared prompts cannot be split for context parallelism")
        index = cp_token_index(self.cu_seqlens, cp_size, cp_rank).to(self.tokens.device)
        sliced = {f.name: getattr(self, f.name).index_select(-1, index) for f in dataclasses.fields(self)
                  if f.name != "cu_seqlens" and isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **sliced, cp=(cp_size, cp_rank))

    def loss_positions(self) -> torch.Tensor:
        """Indices of the positions whose label carries loss, on the micro-batch's device."""
        return torch.nonzero(self.loss_mask[0] > 0).squeeze(1)

    def at_positions(self, index: torch.Tensor | None) -> "PackedMicroBatch":
        """This micro-batch at `index`'s positions only (every per-position tensor; the row's boundaries
        stay): what a loss reads when the logits were made at those positions alone. None: `self`."""
        if index is None:
            return self
        picked = {f.name: getattr(self, f.name).index_select(-1, index) for f in dataclasses.fields(self)
                  if f.name != "cu_seqlens" and isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **picked)

    def attention_mask(self) -> torch.Tensor:
        """Block-diagonal causal mask `[1, 1, T, T]`, Megatron convention: True = masked out."""
        if self.cp is not None:
            raise ValueError("a context-parallel micro-batch has no [T, T] mask: use packed_seq_params()")
        if self.segment_parents is not None:
            raise ValueError("a row with shared prompts has no block-diagonal mask: use packed_seq_params() "
                             "with train.attention's SegmentCausalAttention")
        seg = self.segment_ids
        same = seg.unsqueeze(0) == seg.unsqueeze(1)
        causal = torch.ones(self.length, self.length, dtype=torch.bool, device=seg.device).tril_()
        return ~(same & causal).view(1, 1, self.length, self.length)

    def packed_seq_params(self):
        """THD `PackedSeqParams` for Transformer Engine attention (GPU path)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        # whole-row boundaries (each segment a multiple of 2*CP under CP), as TE's THD CP attention wants
        cu = self.cu_seqlens.to(torch.int32)
        if self.segment_parents is not None:
            from megatron_rl.train.attention import SharedPrefixSeqParams
            from megatron_rl.train.packed_rope import with_positions

            # RoPE reads the branches' positions (continuing their prefix's), which reach past the
            # longest segment: Megatron sizes its frequency table by max_seqlen
            positions = self.position_ids[0]
            longest = int(positions.max().item()) + 1
            return SharedPrefixSeqParams(qkv_format="thd", cu_seqlens_q=with_positions(cu, positions),
                                         cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                                         segment_parents=self.segment_parents)
        max_len = int((cu[1:] - cu[:-1]).max().item())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=max_len, max_seqlen_kv=max_len)


@dataclass
class PackingStats:
    n_sequences: int
    n_bins: int
    real_tokens: int  # tokens of the sequences themselves
    packed_tokens: int  # tokens actually computed (bins after padding)
    naive_tokens: int  # tokens if every sequence were padded to the longest one
    shared_tokens: int = 0  # prompt tokens not in the bins: held once for several sequences

    @property
    def padding_fraction(self) -> float:
        computed = self.real_tokens - self.shared_tokens
        return 1.0 - computed / self.packed_tokens if self.packed_tokens else 0.0

    @property
    def naive_padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.naive_tokens if self.naive_tokens else 0.0


@dataclass
class PackedBatch:
    micro_batches: list[PackedMicroBatch]
    stats: PackingStats
    seq_length: int = field(default=0)  # common length when `pad_to_common` was asked, else max length


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cp_token_index(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Row indices CP rank `cp_rank` holds: per segment of `cu_seqlens` (each a multiple of 2*cp_size
    long), its chunks cp_rank and 2*cp_size-1-cp_rank of 2*cp_size equal chunks."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside a CP group of {cp_size}")
    parts = []
    cu = [int(x) for x in cu_seqlens.tolist()]
    for a, b in zip(cu, cu[1:]):
        if (b - a) % (2 * cp_size):
            raise ValueError(f"segment [{a}, {b}) is not a multiple of 2*CP={2 * cp_size} tokens long")
        c = (b - a) // (2 * cp_size)
        for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(a + j * c, a + (j + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def routes_tensor(routes: RoutedExperts) -> torch.Tensor:
    """A record's expert ids as int16 [positions, layers, topk] (ids below 2**15: any real model)."""
    ids = np.frombuffer(routes.ids, dtype=np.uint8 if routes.itemsize == 1 else "<u2")
    return torch.from_numpy(ids.astype(np.int16)).view(routes.positions, routes.layers, routes.topk)


def _empty_routes(seqs: Sequence[TrainSequence], indices: list[int], length: int) -> torch.Tensor | None:
    """-1 everywhere, shaped for the bin's routes; None when none of its sequences has any."""
    routed = [seqs[i].routed_experts for i in indices if seqs[i].routed_experts is not None]
    return torch.full((routed[0].layers, routed[0].topk, length), -1, dtype=torch.int16) if routed else None


@dataclass(frozen=True)
class _Unit:
    """What packing places whole: one sequence (prefix 0), or sequences sharing their first `prefix` tokens."""

    members: tuple[int, ...]
    prefix: int = 0

    def length(self, lengths: Sequence[int]) -> int:
        return self.prefix + sum(lengths[i] - self.prefix for i in self.members)


def _prompt_groups(seqs: Sequence[TrainSequence]) -> list[_Unit]:
    """In input order: the sequences equal before their last prompt token as one unit with that prefix
    (held once), every other sequence alone (no shared prefix, or routed experts). Not cut to a bin."""
    by_prefix: dict[bytes, list[int]] = {}
    groups: list[list[int]] = []
    for i, s in enumerate(seqs):
        if s.prompt_len < 2 or s.routed_experts is not None:
            groups.append([i])
            continue
        key = np.asarray(s.token_ids[:s.prompt_len - 1], dtype=np.int64).tobytes()
        if key not in by_prefix:
            by_prefix[key] = []
            groups.append(by_prefix[key])  # placed where its first member is
        by_prefix[key].append(i)
    return [_Unit(tuple(g), seqs[g[0]].prompt_len - 1 if len(g) > 1 else 0) for g in groups]


def _computed_tokens(seqs: Sequence[TrainSequence], indices: Sequence[int]) -> int:
    """Tokens the model computes for these sequences when each shared prefix is held once."""
    sub = [seqs[i] for i in indices]
    lengths = [len(s.token_ids) for s in sub]
    return sum(u.length(lengths) for u in _prompt_groups(sub))


def deal_to_ranks(seqs: Sequence[TrainSequence], parts: int, share_prompts: bool) -> list[list[int]]:
    """Deal a minibatch's sequences to `parts` data-parallel ranks. With shared prompts, whole prompt
    groups are dealt (a group split over ranks computes its prompt once per rank) when that leaves the
    busiest rank no more computed tokens than dealing single sequences; every share is non-empty."""
    lengths = [len(s.token_ids) for s in seqs]
    by_sequence = split_balanced(lengths, parts)
    groups = _prompt_groups(seqs) if share_prompts else []
    if len(groups) < parts or all(u.prefix == 0 for u in groups):
        return by_sequence
    cost = [u.length(lengths) for u in groups]
    dealt = split_balanced(cost, parts)
    busiest = max(sum(cost[g] for g in share) for share in dealt)
    if busiest > max(_computed_tokens(seqs, share) for share in by_sequence):
        return by_sequence
    return [sorted(i for g in share for i in groups[g].members) for share in dealt]


def _shared_prompt_units(seqs: Sequence[TrainSequence], lengths: Sequence[int], capacity: int) -> list[_Unit]:
    """`_prompt_groups`, each group cut so that it fits `capacity` (each part with its own prefix copy)."""
    out: list[_Unit] = []
    for u in _prompt_groups(seqs):
        if not u.prefix:
            out.append(u)
            continue
        q = u.prefix
        chunk: list[int] = []
        size = q  # the chunk's tokens with its own copy of the prefix
        for i in u.members:  # greedy in order: a chunk stays under the capacity
            if chunk and size + lengths[i] - q > capacity:
                out.append(_Unit(tuple(chunk), q if len(chunk) > 1 else 0))
                chunk, size = [], q
            chunk.append(i)
            size += lengths[i] - q
        out.append(_Unit(tuple(chunk), q if len(chunk) > 1 else 0))
    return out


def _build_row(seqs: Sequence[TrainSequence], units: list[_Unit], advantages: Sequence[float],
               length: int, pad_id: int, seq_multiple: int = 1) -> PackedMicroBatch:
    indices = [i for u in units for i in u.members]
    tokens = torch.full((length,), pad_id, dtype=torch.long)
    position_ids = torch.zeros(length, dtype=torch.long)
    labels = torch.zeros(length, dtype=torch.long)
    loss_mask = torch.zeros(length, dtype=torch.float32)
    blp = torch.zeros(length, dtype=torch.float32)
    adv = torch.zeros(length, dtype=torch.float32)
    versions = torch.full((length,), -1, dtype=torch.long)
    mixed = torch.zeros(length, dtype=torch.bool)
    segment_ids = torch.full((length,), len(indices), dtype=torch.long)  # prefixes, padding: no sequence
    pad_mask = torch.ones(length, dtype=torch.bool)
    routed = _empty_routes(seqs, indices, length)
    temps = [float(seqs[i].temperature) for i in indices]
    temperature = torch.ones(length, dtype=torch.float32) if any(t != 1.0 for t in temps) else None
    cu, parents = [0], []
    start = real = 0
    j = 0  # the sequence's index in the bin
    for unit in units:
        q, parent = unit.prefix, -1
        if q:  # the shared prefix: context only (every loss position is at or after the last prompt token)
            tokens[start:start + q] = torch.tensor(seqs[unit.members[0]].token_ids[:q], dtype=torch.long)
            pad_mask[start:start + q] = False
            position_ids[start:start + q] = torch.arange(q)
            parent = len(parents)
            parents.append(-1)
            start += q
            real += q
            cu.append(start)
        for i in unit.members:
            s = seqs[i]
            n, p = len(s.token_ids), s.prompt_len
            # this sequence's tokens from index q on sit at start..; index k at row start + k - q
            ids = torch.tensor(s.token_ids[q:], dtype=torch.long)
            tokens[start:start + n - q] = ids
            pad_mask[start:start + n - q] = False
            labels[start:start + n - q - 1] = ids[1:]
            # completion token k (p <= k < n) is predicted at position k-1
            a, e = start + p - 1 - q, start + n - 1 - q
            own = torch.ones(n - p) if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
            loss_mask[a:e] = own
            blp[a:e] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32) * own
            adv[a:e] = float(advantages[i]) * own
            if s.weight_versions:
                sampled = torch.tensor(s.weight_versions, dtype=torch.long)
                versions[a:e] = torch.where(own > 0, sampled, -1)
                mixed[a:e] = mixed_context(sampled, own)
            if s.routed_experts is not None:  # positions 0 .. n-2: the last token was never routed by the generator
                routed[:, :, start:start + n - 1] = routes_tensor(s.routed_experts).permute(1, 2, 0)
            padded = _round_up(n - q, seq_multiple)  # CP: the segment's own pad tokens follow it (no loss)
            position_ids[start:start + padded] = torch.arange(q, q + padded)
            segment_ids[start:start + padded] = j
            if temperature is not None:
                temperature[start:start + padded] = temps[j]
            start += padded
            real += n - q
            cu.append(start)
            parents.append(parent)
            j += 1
    if start < length:  # padding: its own causal segment, positions from 0, no loss
        position_ids[start:] = torch.arange(length - start)
        cu.append(length)
        parents.append(-1)
    return PackedMicroBatch(
        tokens=tokens.unsqueeze(0), position_ids=position_ids.unsqueeze(0), labels=labels.unsqueeze(0),
        loss_mask=loss_mask.unsqueeze(0), behaviour_logprobs=blp.unsqueeze(0), advantages=adv.unsqueeze(0),
        segment_ids=segment_ids, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        seq_indices=indices, n_real_tokens=real,
        temperature=None if temperature is None else temperature.unsqueeze(0),
        weight_versions=versions.unsqueeze(0), mixed_context=mixed.unsqueeze(0), pad_mask=pad_mask.unsqueeze(0),
        routed_experts=routed, segment_parents=tuple(parents) if any(x >= 0 for x in parents) else None)


def pack_sequences(seqs: Sequence[TrainSequence], capacity: int, advantages: Sequence[float] | None = None,
                   pad_multiple: int = 1, pad_to_common: bool = False, pad_id: int = 0,
                   cp: tuple[int, int] = (1, 0), common_length: int = 0, min_bins: int = 0,
                   share_prompts: bool = False) -> PackedBatch:
    """Pack `seqs` into bins of at most `capacity` tokens, one `PackedMicroBatch` per bin.

    advantages: one value per sequence (defaults to each sequence's own `advantage`).
    pad_multiple: round each bin length up to a multiple (e.g. the TP size with sequence parallel).
    pad_to_common: give every bin the same length (pipeline parallelism exchanges fixed shapes).
    cp: (CP size, CP rank): every sequence is padded to a multiple of 2*CP, each bin to a multiple of
        2*CP*pad_multiple, and the micro-batches hold this rank's chunks (`PackedMicroBatch.cp_slice`).
    common_length, min_bins: with pad_to_common, bins at least this long (a multiple of the padding
        multiples), and empty bins (all padding, no loss) up to `min_bins` (MoE expert parallel: every
        rank of the EP group runs the same micro-batches, see step.prepare_minibatch).
    share_prompts: hold a prompt once for the sequences of a bin that share it (module docstring); a
        group whose sequences do not fit one bin together is cut, each part with its own prefix.
    """
    if not seqs:
        raise ValueError("cannot pack an empty list of sequences")
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    seq_multiple = 2 * cp[0] if cp[0] > 1 else 1
    pad_multiple *= seq_multiple  # the bin's padding segment is then a multiple of 2*CP too
    if advantages is None:
        advantages = [s.advantage for s in seqs]
    if len(advantages) != len(seqs):
        raise ValueError(f"{len(advantages)} advantages for {len(seqs)} sequences")
    if share_prompts and cp[0] > 1:
        raise ValueError("shared prompts cannot be packed for context parallelism")
    lengths = [len(s.token_ids) for s in seqs]
    padded = [_round_up(n, seq_multiple) for n in lengths]
    check_fits(padded, capacity)  # here, where the index is the sequence's
    units = (_shared_prompt_units(seqs, lengths, capacity) if share_prompts
             else [_Unit((i,)) for i in range(len(seqs))])
    unit_lengths = [u.length(padded) for u in units]
    bins = first_fit_decreasing(unit_lengths, capacity)
    # keep the order of the input inside each bin, and order bins by their first sequence
    bins = sorted((sorted(b) for b in bins), key=lambda b: b[0])
    bins += [[] for _ in range(min_bins - len(bins))]
    used = [sum(unit_lengths[u] for u in b) for b in bins]
    sizes = [_round_up(u, pad_multiple) for u in used]
    common = max(max(sizes), _round_up(common_length, pad_multiple))
    if pad_to_common:
        sizes = [common] * len(bins)
    mbs = [_build_row(seqs, [units[u] for u in b], advantages, n, pad_id, seq_multiple).cp_slice(*cp)
           for b, n in zip(bins, sizes)]
    shared = sum(u.prefix * (len(u.members) - 1) for u in units)
    stats = PackingStats(n_sequences=len(seqs), n_bins=len(bins), real_tokens=sum(lengths),
                         packed_tokens=sum(sizes), naive_tokens=len(seqs) * max(lengths), shared_tokens=shared)
    return PackedBatch(micro_batches=mbs, stats=stats, seq_length=common)
