"""One RL update on a Batch: trainer-side logprob passes first, then one optimizer step per minibatch.

    prepared = [prepare_minibatch(...) for each of the n_mini minibatches]   # deal + pack once
    proximal logprobs: the policy at the START of the update, forward-only   # algo.proximal: trainer,
                                                                             # or kl_mode: reward
    reference logprobs: the frozen reference policy, forward-only            # kl_mode != none
    teacher logprobs: the frozen distillation teacher, forward-only          # algo.teacher
    KL in the reward: A_i -= kl_coef * (k1_i - baseline_i), then the minibatch normalisation again
    distillation: A_t += distill_coef * (teacher_t - proximal_t)             # algo.distill
    run_minibatch(prepared[m]) for each minibatch

All passes run before the first step, so every minibatch of the update is anchored on the same
proximal policy (the decoupled objective's pi_prox is the policy that the update starts from).

KL in the reward (`kl_mode: reward`): k1_i = sum_t (log pi_prox(y_i,t) - log pi_ref(y_i,t)) is the
sampled sequence-level KL, subtracted from the sample's reward times kl_coef; through the surrogate its
score-function gradient is an unbiased sample of -kl_coef * grad KL(pi || ref) (see algo.kl). It is
centred with a leave-one-out baseline over the other samples of the same group present in the batch
(independent of y_i, so the gradient stays unbiased; 0 when a sample's group-mates are not in the
batch). The adjusted advantage then goes through the configured minibatch normalisation like the
reward-based one.

Distillation (`algo.teacher`): the teacher's logprobs of the sampled tokens and the proximal ones give each
token distill_coef * (teacher - proximal) on top of its sequence's advantage (algo.distill), after the
normalisation; `distill_metrics` reports the teacher KL of the update.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_rl.algo import distill
from megatron_rl.config import AlgoConfig
from megatron_rl.records import TrainSequence
from megatron_rl.train.device import model_device
from megatron_rl.train.step import (PreparedMinibatch, StepContext, collect_logprobs, minibatch_advantages,
                                    prepare_minibatch)


def needs_proximal(algo: AlgoConfig) -> bool:
    # distillation: the student's logprobs of its teacher term are the proximal ones (algo.distill)
    return algo.proximal == "trainer" or algo.kl_mode == "reward" or algo.teacher is not None


def split_minibatches(seqs: Sequence[TrainSequence], n_mini: int) -> list[list[TrainSequence]]:
    size = len(seqs) // n_mini
    return [list(seqs[i * size:(i + 1) * size]) for i in range(n_mini)]


def prepare_update(model: list, reference, minibatches: list[list[TrainSequence]],
                   ctx: StepContext, teacher=None) -> list[PreparedMinibatch]:
    """Collective: pack every minibatch of the update and run the logprob passes the config needs
    (`teacher`: the trainer's `train.teacher.Teacher` when algo.teacher is set)."""
    algo = ctx.algo
    prepared = [prepare_minibatch(model, mb, ctx) for mb in minibatches]
    if needs_proximal(algo):
        for p in prepared:
            collect_logprobs(model, p, ctx, "proximal_logprobs")
    if algo.kl_mode != "none":
        if reference is None:
            raise RuntimeError(f"algo.kl_mode={algo.kl_mode!r} needs the trainer's reference policy")
        for p in prepared:
            collect_logprobs(reference.chunks, p, ctx, "ref_logprobs")
    if algo.teacher is not None:
        if teacher is None:
            raise RuntimeError("algo.teacher is set but the trainer holds no teacher model")
        for p in prepared:
            collect_logprobs(teacher.chunks, p, teacher.context(ctx), "teacher_logprobs")
    if algo.kl_mode == "reward":
        _apply_kl_reward(prepared, ctx, model_device(model))
    if algo.teacher is not None:  # last: per-token terms on top of the (normalised) sequence advantages
        _apply_distillation(prepared, algo)
    # proximal logprobs computed for the KL only stay on the micro-batches: the mismatch metrics read
    # them; the loss anchors its ratio on them only with algo.proximal: trainer (train.step)
    return prepared


def _sequence_k1(p: PreparedMinibatch, device: torch.device) -> torch.Tensor:
    """[len(p.seqs)] float64 on `device` (the model's, where the micro-batches live): sum over each
    sequence's completion of (proximal - reference), from the micro-batches this rank holds (zeros
    elsewhere, and on stages before the last)."""
    k1 = torch.zeros(len(p.seqs), dtype=torch.float64, device=device)
    for mb in p.packed.micro_batches:
        if mb.ref_logprobs is None:  # not the last pipeline stage
            continue
        diff = torch.where(mb.loss_mask[0] > 0, (mb.proximal_logprobs - mb.ref_logprobs)[0], 0.0).double()
        sums = torch.zeros(len(mb.seq_indices) + 1, dtype=torch.float64, device=device).index_add_(
            0, mb.segment_ids, diff)
        # each sequence sits in exactly one micro-batch: one scatter per micro-batch, no per-element copies
        rows = torch.tensor([p.share[local] for local in mb.seq_indices], device=device)
        k1.index_add_(0, rows, sums[:-1])
    return k1


def _share_with_all_ranks(t: torch.Tensor) -> torch.Tensor:
    """Sum over DP x CP ranks (each holds its share), then broadcast from the last pipeline stage. `t` lives
    on the model's device, which is the one the trainer's process group carries (see train.device)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        return t
    # DP x CP: CP ranks hold disjoint tokens of the same sequences, their partial sums add up
    dist.all_reduce(t, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return t


def kl_reward_advantages(seqs: Sequence[TrainSequence], k1: Sequence[float], kl_coef: float) -> list[float]:
    """A_i - kl_coef * (k1_i - mean of k1 over the other members of i's group in `seqs`)."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(seqs):
        members[s.group_id or f"#{i}"].append(i)
    out = []
    for i, s in enumerate(seqs):
        mates = [j for j in members[s.group_id or f"#{i}"] if j != i]
        baseline = sum(k1[j] for j in mates) / len(mates) if mates else 0.0
        out.append(s.advantage - kl_coef * (k1[i] - baseline))
    return out


def _apply_kl_reward(prepared: list[PreparedMinibatch], ctx: StepContext, device: torch.device) -> None:
    k1 = torch.cat([_share_with_all_ranks(_sequence_k1(p, device)) for p in prepared]).tolist()
    seqs = [s for p in prepared for s in p.seqs]
    adjusted = kl_reward_advantages(seqs, k1, ctx.algo.kl_coef)
    offset = 0
    for p in prepared:
        values = minibatch_advantages(p.seqs, ctx.algo, adjusted[offset:offset + len(p.seqs)])
        offset += len(p.seqs)
        local = [values[i] for i in p.share]
        for mb in p.packed.micro_batches:
            mb.set_advantages(local)


def _apply_distillation(prepared: list[PreparedMinibatch], algo: AlgoConfig) -> None:
    for p in prepared:
        for mb in p.packed.micro_batches:
            if mb.teacher_logprobs is not None:  # the last pipeline stage: the only one with a loss
                mb.advantages = distill.distill_advantages(mb.advantages, mb.teacher_logprobs, mb.proximal_logprobs,
                                                           mb.loss_mask > 0, algo.distill_coef, algo.distill_only)


def distill_metrics(prepared: list[PreparedMinibatch], ctx: StepContext, device: torch.device) -> dict[str, float]:
    """Collective: `distill/...` of the update's sampled tokens (algo.distill.metrics), the same on every rank."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for p in prepared:
        for mb in p.packed.micro_batches:
            if mb.teacher_logprobs is not None:
                sums += distill.metric_sums(mb.teacher_logprobs, mb.proximal_logprobs, mb.loss_mask > 0,
                                            ctx.algo.distill_coef)
    return distill.metrics(_share_with_all_ranks(sums).cpu())
