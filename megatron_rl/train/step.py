"""The RL update: one optimizer step per minibatch, through Megatron's pipeline schedules.

For each minibatch (every trainer rank holds the same whole minibatch):
1. advantages are standardised over the whole minibatch (`algo.advantages.normalize`; the
   statistics are therefore minibatch-wide across all DP ranks without communication);
2. its sequences are dealt to the DP ranks balancing token counts (whole prompt groups where prompts
   are shared), and each rank packs its share into bins of `micro_batch_tokens` (one packed
   micro-batch per bin);
3. Megatron's forward/backward schedule (no pipelining, or 1F1B / interleaved under PP) runs the
   micro-batches; the loss function returns the clipped-surrogate token SUM and the token count, and
   `finalize_model_grads` divides the gradients by the total count over micro-batches and DP ranks,
   so accumulation equals the full-minibatch token-normalised loss;
4. the optimizer clips the global gradient norm and steps.

The RL loss is `megatron_rl.ops.fused_clipped_loss` (csrc kernels: log-softmax fused with the
surrogate, vocab-parallel under TP with Megatron's vocab padding excluded, no float32
[tokens, vocab] tensor; bf16 logits stay bf16, see `optimizer.wrap_model`). Ratio and clip
statistics come from the per-token logprobs its forward computed; the entropy metric costs one
no-grad chunked pass over the logits and is skipped (the key is absent) when `trainer.log_entropy` is false.
Logits are divided by each sequence's sampling temperature before anything reads them: the generator's
behaviour logprobs are of log_softmax(logits / T), so the ratio compares like with like.
Trainer-side logprobs (`collect_logprobs`: the proximal policy of the decoupled objective, the reference
policy of the KL, the distillation teacher) run the same packed micro-batches forward-only and are stored on them (train.update
orchestrates those passes per update); with `algo.kl_mode: k2` the fused loss adds the sequence-level
k2 term with weight kl_coef * n_tokens / n_sequences of the minibatch, so that after Megatron's division
by the token count it is kl_coef times the minibatch mean of 1/2 (log pi(y) - log ref(y))^2.
The same machinery runs SFT (`objective="sft"`: cross-entropy on completion tokens, `train.logprobs.token_logprobs`).
Metrics are reduced over micro-batches and DP x CP ranks and broadcast from the last pipeline stage,
so every rank returns the same numbers.
Context parallel: each CP rank keeps its chunks of the same bins (packing.py); counts and grads sum over DP x CP.
Mismatch metrics (`algo.mismatch`): trainer logprobs of the update start's weights vs the generator's,
by version lag (lag 0 also split by whether the token's context came from one version), from the
proximal pass when one ran, else from the loss forward's own logprobs where
the weights are still `ctx.policy_version` (`ctx.weights_at_version`: an update's first minibatch).
The importance-sampling correction (`algo.correction`) goes to the fused loss with the packed row's
sequence boundaries (for sequence_tis).
Devices: `prepare_minibatch` moves the packed micro-batches to the model's device once
(`train.device.model_device`); the loss statistics, the metric and count reductions are made there too,
so the collectives send tensors the process group can carry (CUDA on NCCL, CPU on gloo).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal, Sequence

import torch
import torch.distributed as dist

from megatron_rl.algo import mismatch
from megatron_rl.algo.advantages import normalize
from megatron_rl.algo.correction import is_correction
from megatron_rl.algo.loss import clipped_token_loss_with_stats, entropy_bonus_terms
from megatron_rl.config import AlgoConfig, TrainerConfig
from megatron_rl.records import TrainSequence
from megatron_rl.ops import SequenceKL, fused_clipped_loss
from megatron_rl.train import moe
from megatron_rl.train.device import model_device
from megatron_rl.train.logprobs import token_entropy, token_logprobs
from megatron_rl.train.packing import PackedBatch, PackedMicroBatch, PackingStats, deal_to_ranks, pack_sequences
from megatron_rl.train.parallel import cp_size_rank, dp_cp_group, dp_sum_ints

Objective = Literal["rl", "sft"]
# Reduced per micro-batch: sums, then mins/maxes (order matters for the all-reduce below).
_SUM_KEYS = ("loss_sum", "n_tokens", "clip_low", "clip_high", "ratio_sum", "entropy_sum", "logprob_sum",
             "kl_sum", "seq_count", "is_weight_sum", "is_masked_sum")
_MIN_KEYS = ("ratio_min",)
_MAX_KEYS = ("ratio_max",)


@dataclass
class StepContext:
    """What a step needs besides the model: configs, parallel layout and the real vocab size."""

    algo: AlgoConfig
    trainer: TrainerConfig
    layout: object  # ParallelLayout
    vocab_size: int
    use_thd: bool = False  # packed THD attention (Transformer Engine); explicit masks otherwise
    kl_weight: float = 0.0  # weight of the sequence-level k2 term in this minibatch's token-sum loss
    policy_version: int = 0  # the trainer's version (updates done): token lag = policy_version - its version
    # the weights are exactly those of policy_version (first minibatch of an update, or an evaluation):
    # the loss forward's logprobs then give the mismatch metrics when no proximal pass ran
    weights_at_version: bool = False


@dataclass
class PreparedMinibatch:
    """One optimizer minibatch (the same whole list on every rank) and this DP rank's packed share."""

    seqs: list[TrainSequence]
    share: list[int]  # indices into seqs packed on this rank
    packed: PackedBatch


def minibatch_advantages(seqs: Sequence[TrainSequence], algo: AlgoConfig,
                         values: Sequence[float] | None = None) -> list[float]:
    """Per-sequence advantages (`values`, else each sequence's own) after the minibatch normalisation
    the config asks for. Host-side (CPU) on purpose: the values go back to Python floats for packing."""
    adv = torch.tensor([s.advantage for s in seqs] if values is None else list(values), dtype=torch.float64)
    if algo.adv_norm != "minibatch":  # `group` is done by the controller when grouping; `none` is none
        return adv.tolist()
    lengths = torch.tensor([s.n_loss_tokens for s in seqs])  # token weights: the tokens that carry loss
    mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    return normalize(adv, mask, mode="minibatch", weighting=algo.adv_norm_weighting).tolist()


def _pad_multiple(chunk_config) -> int:
    return chunk_config.tensor_model_parallel_size if chunk_config.sequence_parallel else 1


def _forward(model_chunk, mb: PackedMicroBatch, use_thd: bool, positions: torch.Tensor | None = None):
    """The chunk's output on `mb`; on the last stage, logits at `positions` of the row only (None: all)."""
    from megatron_rl.train import attention, routing_replay

    # bf16 chunks: bf16 logits (no float32 [tokens, vocab] copy by Float16Module); losses sum in float32
    kw = {"fp32_output": False} if getattr(model_chunk, "mrl_half_precision", False) else {}
    with moe.router_padding(model_chunk, mb, kw) as kw, _output_layer_at(model_chunk, positions):
        routing_replay.set_targets(model_chunk, mb)  # MoE: the generator's experts (algo.routing_replay)
        # THD boundaries instead of a [T, T] mask: Transformer Engine, or the local spec's segment attention
        if mb.segment_parents is not None and not attention.uses_segment_attention(model_chunk):
            raise ValueError("a packed row with shared prompts reached a model without train.attention's "
                             "SegmentCausalAttention (set trainer.share_prompts: false)")
        if use_thd or attention.uses_segment_attention(model_chunk):
            return model_chunk(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params(), **kw)
        return model_chunk(mb.tokens, mb.position_ids, mb.attention_mask(), **kw)


def _logit_positions(model_chunk, mb: PackedMicroBatch) -> torch.Tensor | None:
    """The positions whose logits a loss or logprob pass reads (those with a loss label), when the
    chunk holds the output layer and may apply it to them alone; None: at every position. Why: the
    output layer is ~1/5 of a small model's matmuls and the log-softmax passes over [tokens, vocab] come
    on top, while the prompt tokens (most of an RL row) need none. Not under sequence parallelism (the
    layer's input is a shard it gathers itself) nor with multi-token prediction (it reads all logits)."""
    from megatron.core.utils import get_attr_wrapped_model

    config = get_attr_wrapped_model(model_chunk, "config")
    if (not get_attr_wrapped_model(model_chunk, "post_process") or config.sequence_parallel
            or getattr(config, "mtp_num_layers", None)):
        return None
    index = mb.loss_positions()
    return index if 0 < len(index) < mb.length else None


@contextlib.contextmanager
def _output_layer_at(model_chunk, positions: torch.Tensor | None):
    """While inside: the chunk's output layer reads its input ([s, b, h]) at `positions` only."""
    if positions is None:
        yield
        return
    from megatron.core.utils import get_attr_wrapped_model

    def select(_module, args, kwargs):
        return (args[0].index_select(0, positions), *args[1:]), kwargs

    handle = get_attr_wrapped_model(model_chunk, "output_layer").register_forward_pre_hook(select, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _tempered(logits: torch.Tensor, mb: PackedMicroBatch) -> torch.Tensor:
    """logits / T per position (a copy only when some sequence was sampled at T != 1)."""
    if mb.temperature is None:
        return logits
    return logits / mb.temperature.to(device=logits.device, dtype=logits.dtype)[..., None]


def _rl_loss(logits: torch.Tensor, mb: PackedMicroBatch, mask: torch.Tensor, ctx: StepContext, tp_group):
    """Fused clipped-surrogate token SUM (log-softmax fused, vocab-parallel, logits in their own dtype)
    plus the k2 KL term when asked, and the ratio/clip/KL statistics of the per-token logprobs its
    forward computed."""
    algo = ctx.algo
    kl = None
    if algo.kl_mode == "k2":
        kl = SequenceKL(mb.ref_logprobs, mb.segment_ids[None], ctx.kl_weight, n_segments=len(mb.cu_seqlens) - 1)
    # the proximal logprobs anchor the ratio only with proximal: trainer (else they serve the KL/metrics)
    proximal = mb.proximal_logprobs if algo.proximal == "trainer" else None
    correction, segments = is_correction(algo), mb.segment_ids[None]
    loss_sum, logp = fused_clipped_loss(
        logits, mb.labels, mb.behaviour_logprobs, mb.advantages, mask, algo.eps_low, algo.eps_high,
        tp_group, normalizer=1.0, vocab_size=ctx.vocab_size, correction=correction, segment_ids=segments,
        proximal_logprobs=proximal, kl=kl,
        # the gradient overwrites the logits buffer unless the entropy bonus's backward still reads them
        inplace_backward=algo.entropy_coef == 0, return_logprobs=True)
    with torch.no_grad():  # O(tokens): the surrogate's statistics on the same logprobs
        _, st = clipped_token_loss_with_stats(logp, mb.behaviour_logprobs, mb.advantages, mask,
                                              algo.eps_low, algo.eps_high, normalizer=1.0,
                                              proximal_logprobs=proximal, correction=correction,
                                              segment_ids=segments)
        kl_sum = (torch.where(mask, logp - mb.ref_logprobs, 0.0).sum() if mb.ref_logprobs is not None
                  else torch.zeros((), device=logp.device))
    stats = {"clip_low": st.clip_frac_low * st.n_tokens, "clip_high": st.clip_frac_high * st.n_tokens,
             "ratio_sum": st.ratio_mean * st.n_tokens, "ratio_min": st.ratio_min, "ratio_max": st.ratio_max,
             "kl_sum": kl_sum, "is_weight_sum": st.is_weight_mean * st.n_tokens,
             "is_masked_sum": st.is_masked_frac * st.n_tokens}
    return loss_sum, logp, stats


def _mismatch_stats(mb: PackedMicroBatch, logp: torch.Tensor | None, mask: torch.Tensor,
                    ctx: StepContext) -> dict[str, torch.Tensor]:
    """Per-lag mismatch sums of this micro-batch (zeros when it has no logprobs of the update start)."""
    start = mb.proximal_logprobs if mb.proximal_logprobs is not None else (
        logp if ctx.weights_at_version else None)
    if start is None or mb.weight_versions is None:
        n_bins = mismatch.N_BINS
        return {"mismatch_sums": torch.zeros(n_bins * len(mismatch.SUM_FIELDS), device=mask.device),
                "mismatch_max": torch.zeros(n_bins, device=mask.device)}
    versions = mb.weight_versions
    lag = torch.where(versions >= 0, ctx.policy_version - versions, -1)
    sums, maxes = mismatch.mismatch_sums(start, mb.behaviour_logprobs, lag, mask, mb.mixed_context)
    return {"mismatch_sums": sums.reshape(-1), "mismatch_max": maxes}


def _loss_func(mb: PackedMicroBatch, ctx: StepContext, objective: Objective, output: torch.Tensor):
    """Token-sum loss, token count, and detached sums for the metrics of this micro-batch.

    `output` stays in the model dtype (bf16 or fp32): both paths read it in float32 chunks. Every
    statistic is made on the output's device: the schedule sums the counts, `_reduce_metrics` stacks them."""
    from megatron.core import parallel_state as ps

    dev = output.device

    tp_group = ps.get_tensor_model_parallel_group() if ctx.layout.tp > 1 else None
    mask = mb.loss_mask > 0
    n = mask.sum()
    log_entropy = ctx.trainer.log_entropy
    entropy = None
    if objective == "rl":
        output = _tempered(output, mb)
        bonus = ctx.algo.entropy_coef > 0  # graph-connected entropy, its token sum beside the fused loss
        if bonus or log_entropy:  # before the loss: its backward overwrites the logits (unless the bonus)
            entropy = token_entropy(output if bonus else output.detach(), tp_group, vocab_size=ctx.vocab_size)
        loss_sum, logp, stats = _rl_loss(output, mb, mask, ctx, tp_group)
        if bonus:
            loss_sum = loss_sum + torch.where(mask, entropy_bonus_terms(entropy, ctx.algo.entropy_coef), 0.0).sum()
    else:
        res = token_logprobs(output, mb.labels, tp_group=tp_group, vocab_size=ctx.vocab_size,
                             with_entropy=log_entropy)
        logp, entropy = res if log_entropy else (res, None)
        loss_sum = -torch.where(mask, logp, 0.0).sum()
        zero = torch.zeros((), dtype=torch.float32, device=dev)
        one = torch.ones((), dtype=torch.float32, device=dev)
        stats = {"clip_low": zero, "clip_high": zero, "ratio_sum": n.float(), "ratio_min": one,
                 "ratio_max": one, "kl_sum": zero, "is_weight_sum": n.float(), "is_masked_sum": zero}
    with torch.no_grad():
        reduced = {"loss_sum": loss_sum.detach().float(), "n_tokens": n.float(),
                   "entropy_sum": (torch.where(mask, entropy, 0.0).sum().float() if entropy is not None
                                   else torch.tensor(float("nan"), device=dev)),
                   "logprob_sum": torch.where(mask, logp.detach(), 0.0).sum().float(),
                   # a sequence spans every CP rank: counted once, on CP rank 0
                   "seq_count": torch.tensor(float(len(mb.seq_indices) * (not mb.cp or mb.cp[1] == 0)), device=dev)}
        reduced.update({k: v.float() for k, v in stats.items()})
        reduced.update(_mismatch_stats(mb, logp.detach() if objective == "rl" else None, mask, ctx))
    # the schedule backpropagates loss_sum; finalize_model_grads divides grads by the summed count
    return loss_sum, n.to(torch.int), reduced


def _forward_step(ctx: StepContext, objective: Objective, data_iterator, model_chunk):
    mb = next(data_iterator)
    positions = _logit_positions(model_chunk, mb)
    output = _forward(model_chunk, mb, ctx.use_thd, positions)
    return output, partial(_loss_func, mb.at_positions(positions), ctx, objective)


def _reduce_metrics(stores: list[dict], ctx: StepContext, device: torch.device) -> dict[str, float]:
    """Combine micro-batch sums over DP ranks and share them from the last PP stage with everyone.
    `device`: the model's (stages without stores still join the collectives with tensors there)."""
    from megatron.core import parallel_state as ps

    big = torch.finfo(torch.float32).max
    n_bins = mismatch.N_BINS
    n_mm = n_bins * len(mismatch.SUM_FIELDS)
    # the mismatch sums and maxima ride in the same tensors (and collectives) as the scalar ones;
    # |d| >= 0, so 0 is the neutral start of their maxima
    sums = torch.zeros(len(_SUM_KEYS) + n_mm, device=device)
    mins = torch.full((len(_MIN_KEYS),), big, device=device)
    maxs = torch.cat([torch.full((len(_MAX_KEYS),), -big, device=device), torch.zeros(n_bins, device=device)])
    for d in stores:
        if float(d["n_tokens"]) == 0:
            continue
        sums += torch.cat([torch.stack([d[k] for k in _SUM_KEYS]), d["mismatch_sums"]])
        mins = torch.minimum(mins, torch.stack([d[k] for k in _MIN_KEYS]))
        maxs = torch.maximum(maxs, torch.cat([torch.stack([d[k] for k in _MAX_KEYS]), d["mismatch_max"]]))
    if dist.is_initialized():
        dp = dp_cp_group()  # CP ranks hold disjoint tokens of the same sequences
        dist.all_reduce(sums, group=dp)
        dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=dp)
        dist.all_reduce(maxs, op=dist.ReduceOp.MAX, group=dp)
        if ctx.layout.pp > 1:
            flat = torch.cat([sums, mins, maxs])
            last = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(flat, src=last, group=ps.get_pipeline_model_parallel_group())
            sums, mins, maxs = flat.split([len(sums), len(mins), len(maxs)])
    sums, mm_sums = sums.split([len(_SUM_KEYS), n_mm])
    maxs, mm_max = maxs.split([len(_MAX_KEYS), n_bins])
    s = dict(zip(_SUM_KEYS, sums.tolist()))
    n = max(s["n_tokens"], 1.0)
    out = {"loss": s["loss_sum"] / n, "n_loss_tokens": s["n_tokens"],
           "clip_frac_low": s["clip_low"] / n, "clip_frac_high": s["clip_high"] / n,
           "ratio_mean": s["ratio_sum"] / n, "ratio_min": float(mins[0]), "ratio_max": float(maxs[0]),
           "logprob_mean": s["logprob_sum"] / n}
    if ctx.trainer.log_entropy:  # not measured otherwise: absent rather than NaN in the metrics files
        out["entropy"] = s["entropy_sum"] / n
    if ctx.algo.kl_mode != "none":  # per-sequence k1 estimate of KL(policy || reference)
        out["kl"] = s["kl_sum"] / max(s["seq_count"], 1.0)
    if ctx.algo.proximal == "trainer" or is_correction(ctx.algo).active:  # mean corrected IS weight
        out["is_weight_mean"] = s["is_weight_sum"] / n
    if ctx.algo.is_correction == "token_mask":  # tokens whose ratio left the band: out of the loss
        out["is_masked_frac"] = s["is_masked_sum"] / n
    out.update(mismatch.metrics(mm_sums.cpu(), mm_max.cpu()))
    return out


@dataclass
class ForwardBackwardResult:
    metrics: dict[str, float]  # reduced over micro-batches and DP ranks, identical on every rank
    stats: PackingStats  # this rank's packing
    n_micro_batches: int


def prepare_minibatch(model: list, seqs: Sequence[TrainSequence], ctx: StepContext,
                      objective: Objective = "rl") -> PreparedMinibatch:
    """Normalise the minibatch's advantages, deal its sequences to the DP ranks (`deal_to_ranks`)
    and pack this rank's share into micro-batches (the same on every call with the same input)."""
    from megatron.core import parallel_state as ps

    if not seqs:
        raise ValueError("empty minibatch")
    seqs = list(seqs)
    advantages = minibatch_advantages(seqs, ctx.algo) if objective == "rl" else [0.0] * len(seqs)
    share_prompts = shares_prompts(model, ctx)
    share = deal_to_ranks(seqs, ps.get_data_parallel_world_size(), share_prompts)[ps.get_data_parallel_rank()]
    device = model_device(model)
    pack_args = dict(advantages=[advantages[i] for i in share], pad_multiple=_pad_multiple(model[0].config),
                     pad_to_common=ctx.layout.pp > 1 or ctx.layout.ep > 1, cp=cp_size_rank(),
                     share_prompts=share_prompts)
    packed = pack_sequences([seqs[i] for i in share], ctx.trainer.micro_batch_tokens, **pack_args)
    if ctx.layout.ep > 1:  # MoE token dispatch is collective over EP: the same bins on every rank
        most = torch.tensor([packed.seq_length, len(packed.micro_batches)], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        packed = pack_sequences([seqs[i] for i in share], ctx.trainer.micro_batch_tokens, **pack_args,
                                common_length=int(most[0]), min_bins=int(most[1]))
    # once per minibatch: every pass over it (logprobs, loss) then reads tensors on the model's device
    packed.micro_batches = [mb.to(device) for mb in packed.micro_batches]
    if ctx.layout.n_chunks > 1 and len(packed.micro_batches) % ctx.layout.pp:
        raise ValueError(f"interleaved pipeline needs the micro-batch count ({len(packed.micro_batches)}) to be "
                         f"a multiple of pp={ctx.layout.pp}; lower trainer.micro_batch_tokens or change the minibatch")
    return PreparedMinibatch(seqs, share, packed)


def shares_prompts(model: list, ctx: StepContext) -> bool:
    """trainer.share_prompts where a row can hold a prompt once for its sequences: every chunk attends
    per segment (train.attention; Transformer Engine's kernels know no prefix segments), no context
    parallelism, no multi-token prediction (it rolls labels along the whole row)."""
    from megatron_rl.train import attention

    config = model[0].config
    return (ctx.trainer.share_prompts and ctx.layout.cp == 1 and not ctx.use_thd
            and not getattr(config, "mtp_num_layers", None)
            and all(attention.uses_segment_attention(chunk) for chunk in model))


def _schedule(model: list, prepared: PreparedMinibatch, forward_step, forward_only: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_rl.train import routing_replay

    # Megatron keeps the aux-loss scale in a class attribute that a backward outside a schedule creates
    # 0-d and the schedule then copies its [1]-shaped scale into (a shape error): the schedule sets it
    # for every micro-batch anyway, so it starts unset
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    mbs = prepared.packed.micro_batches
    iters = [iter(mbs) for _ in model] if len(model) > 1 else iter(mbs)
    with routing_replay.replaying(model):
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iters, model=model, num_microbatches=len(mbs),
            seq_length=prepared.packed.seq_length, micro_batch_size=1, forward_only=forward_only)


def _store_logprobs(mb: PackedMicroBatch, positions: torch.Tensor | None, ctx: StepContext, field: str,
                    output: torch.Tensor):
    """`mb.<field>`: the logprobs of `output` (made at `positions` of the row, None: all) over the whole row."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group() if ctx.layout.tp > 1 else None
    at_output = mb.at_positions(positions)
    with torch.no_grad():
        logp = token_logprobs(_tempered(output, at_output), at_output.labels, tp_group=tp_group,
                              vocab_size=ctx.vocab_size)
        logp = torch.where(at_output.loss_mask > 0, logp.float(), 0.0)
        if positions is not None:
            logp = torch.zeros_like(mb.loss_mask).index_copy_(1, positions, logp)
    setattr(mb, field, logp)
    # a dummy loss; a count of 1 keeps the schedule's normalisation finite (both on the model's device,
    # where the schedule accumulates the counts)
    return (torch.zeros((), dtype=torch.float32, device=output.device),
            torch.ones((), dtype=torch.int, device=output.device), {})


def _logprob_step(ctx: StepContext, field: str, data_iterator, model_chunk):
    mb = next(data_iterator)
    positions = _logit_positions(model_chunk, mb)
    return _forward(model_chunk, mb, ctx.use_thd, positions), partial(_store_logprobs, mb, positions, ctx, field)


@torch.no_grad()
def collect_logprobs(model: list, prepared: PreparedMinibatch, ctx: StepContext, field: str) -> None:
    """Collective, forward-only: per-token logprobs (tempered like the loss) of `model` on the packed
    micro-batches, stored as `mb.<field>` ("proximal_logprobs", "ref_logprobs" or "teacher_logprobs") on the
    last stage."""
    if field not in ("proximal_logprobs", "ref_logprobs", "teacher_logprobs"):
        raise ValueError(f"unknown logprob field {field!r}")
    _schedule(model, prepared, partial(_logprob_step, ctx, field), forward_only=True)


def forward_backward(model: list, seqs: Sequence[TrainSequence] | PreparedMinibatch, ctx: StepContext,
                     objective: Objective = "rl", forward_only: bool = False) -> ForwardBackwardResult:
    """Collective: gradients of the minibatch loss in the DDP grad buffers (no optimizer step).
    `seqs` may be a minibatch already prepared (and given trainer-side logprobs) by `prepare_minibatch`."""
    from megatron.core import parallel_state as ps

    prepared = seqs if isinstance(seqs, PreparedMinibatch) else prepare_minibatch(model, seqs, ctx, objective)
    seqs, packed = prepared.seqs, prepared.packed
    if objective == "rl" and ctx.algo.kl_mode == "k2":
        n_tok = sum(s.n_loss_tokens for s in seqs)
        ctx = dataclasses.replace(ctx, kl_weight=ctx.algo.kl_coef * n_tok / len(seqs))
    if not forward_only:
        for chunk in model:
            chunk.zero_grad_buffer()
    stores = _schedule(model, prepared, partial(_forward_step, ctx, objective), forward_only)
    moe.release_dispatch_state(model)
    device = model_device(model)
    metrics = _reduce_metrics(stores if ps.is_pipeline_last_stage(ignore_virtual=True) else [], ctx, device)
    if ctx.algo.routing_replay:
        from megatron_rl.train import routing_replay

        metrics.update(routing_replay.agreement_metrics(model, device))
    real, packed_tok, shared = dp_sum_ints([packed.stats.real_tokens, packed.stats.packed_tokens,
                                            packed.stats.shared_tokens], device)
    naive = len(seqs) * max(len(s.token_ids) for s in seqs)  # baseline: every sequence padded to the longest
    n_mbs = len(packed.micro_batches)
    metrics.update({
        "tokens": float(real), "padding_fraction": 1.0 - (real - shared) / packed_tok,
        "shared_prompt_fraction": shared / real,  # of the sequences' tokens, held once for several
        "naive_padding_fraction": 1.0 - real / naive, "n_micro_batches": float(n_mbs),
        "n_sequences": float(len(seqs)),
    })
    return ForwardBackwardResult(metrics, packed.stats, n_mbs)


def run_minibatch(model: list, optimizer, seqs: Sequence[TrainSequence] | PreparedMinibatch, ctx: StepContext,
                  objective: Objective = "rl", forward_only: bool = False) -> dict[str, float]:
    """Collective over all trainer ranks: one optimizer step on one minibatch; returns metrics.

    forward_only=True evaluates the loss and metrics without touching gradients or weights.
    """
    t0 = time.perf_counter()
    if not forward_only:
        optimizer.zero_grad()
    result = forward_backward(model, seqs, ctx, objective, forward_only)
    grad_norm = None
    if not forward_only:
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise FloatingPointError("optimizer step skipped (non-finite gradients)")
    elapsed = time.perf_counter() - t0
    metrics = dict(result.metrics)
    metrics.update({
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "tokens_per_s": metrics["tokens"] / elapsed, "step_time_s": elapsed,
    })
    return metrics
