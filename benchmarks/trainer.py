"""Trainer throughput: megatron_rl's RL step (Megatron-Core, packed micro-batches, Megatron optimizer)
vs HF transformers + torch AdamW on the same batch, same loss, same precision, in one run.

    .venv/bin/python benchmarks/trainer.py [--model smollm2-135m] [--seqs 16] [--min-len 64]
        [--max-len 256] [--micro-tokens 1024] [--steps 3] [--precision fp32]
        [--core-attention segment|megatron] [--group-size 8 [--no-share-prompts]]

The HF baseline pads each micro-batch of `--hf-micro` sequences to its longest sequence (the usual
way) and uses the reference clipped loss with the same token normaliser. The two steps alternate
(after one warm-up step each), in swapped order every round, so that load from other processes on a
shared machine falls on both alike; the ratio is the median over rounds of the per-round ratio.
Prints tokens/s of both (real tokens only, median over `--steps` rounds) and the ratio. Single
process (TP=PP=DP=1); on GPU both run on the device. `--core-attention megatron` builds the local
spec with Megatron's DotProductAttention (full [T, T] masked scores) instead of the default
SegmentCausalAttention, to measure what the per-segment attention changes (CPU / no TE only).
`--group-size K`: the sequences come in groups of K samples of one prompt (GRPO's groups; the prompt
is `--prompt-frac` of the group's first sample); our trainer holds each prompt once per micro-batch
(trainer.share_prompts) unless `--no-share-prompts`, while HF computes every sequence whole, the usual way.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def make_batch(vocab: int, n: int, min_len: int, max_len: int, seed: int = 0, prompt_frac: float = 0.25,
               group_size: int = 1):
    from megatron_rl.records import Batch, TrainSequence

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        total = int(torch.randint(min_len, max_len + 1, (), generator=g))
        if i % group_size == 0:  # a new group: its prompt
            prompt_ids = torch.randint(0, vocab, (min(total - 1, max(1, int(total * prompt_frac))),), generator=g)
        prompt = len(prompt_ids)
        ids = prompt_ids.tolist() + torch.randint(0, vocab, (max(1, total - prompt),), generator=g).tolist()
        seqs.append(TrainSequence(ids, prompt, [-2.0] * (len(ids) - prompt), advantage=float(i % 2) * 2 - 1))
    return Batch(seqs, n_mini=1, policy_version=0)


def hf_step(model, opt, seqs, micro: int, eps_low: float, eps_high: float, device, dtype) -> None:
    from megatron_rl.algo.loss import clipped_token_loss

    n_tokens = sum(s.completion_len for s in seqs)
    opt.zero_grad(set_to_none=True)
    for start in range(0, len(seqs), micro):
        chunk = seqs[start:start + micro]
        width = max(len(s.token_ids) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        att = torch.zeros_like(ids)
        mask = torch.zeros(len(chunk), width - 1, dtype=torch.bool)
        behav = torch.zeros(len(chunk), width - 1)
        for i, s in enumerate(chunk):
            n = len(s.token_ids)
            ids[i, :n] = torch.tensor(s.token_ids)
            att[i, :n] = 1
            mask[i, s.prompt_len - 1:n - 1] = True
            behav[i, s.prompt_len - 1:n - 1] = torch.tensor(s.behaviour_logprobs)
        adv = torch.tensor([s.advantage for s in chunk])
        ids, att, mask, behav, adv = (t.to(device) for t in (ids, att, mask, behav, adv))
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = clipped_token_loss(logp, behav, adv, mask, eps_low, eps_high, normalizer=n_tokens)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def timed_pairs(fn_a, fn_b, rounds: int) -> tuple[list[float], list[float]]:
    """Step times of a and b, alternating (a b, b a, a b, ...) after one warm-up step of each."""
    fn_a()
    fn_b()
    ta, tb = [], []
    for i in range(rounds):
        if i % 2 == 0:
            ta.append(_time(fn_a))
            tb.append(_time(fn_b))
        else:
            tb.append(_time(fn_b))
            ta.append(_time(fn_a))
    return ta, tb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--prompt-frac", type=float, default=0.25, help="share of each sequence that is prompt (no "
                    "loss; the CPU demo's rows are ~0.65 prompt)")
    ap.add_argument("--group-size", type=int, default=1, help="samples per prompt (default 1: every prompt "
                    "its own)")
    ap.add_argument("--no-share-prompts", action="store_true", help="trainer.share_prompts: false")
    ap.add_argument("--micro-tokens", type=int, default=1024, help="packing bin capacity (Megatron)")
    ap.add_argument("--hf-micro", type=int, default=4, help="sequences per padded HF micro-batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--core-attention", choices=["segment", "megatron"], default="segment",
                    help="local spec core attention (segment: SegmentCausalAttention)")
    args = ap.parse_args()
    if args.core_attention == "megatron":
        import functools

        from megatron_rl.train import model as model_mod

        model_mod.layer_spec = functools.partial(model_mod.layer_spec, segment_attention=False)

    from megatron_rl.config import config_from_dict
    from megatron_rl.train.hf_source import resolve_model
    from megatron_rl.train.trainer import Trainer

    cfg = config_from_dict({"trainer": {"model": args.model, "precision": args.precision, "lr": 1e-6,
                                        "micro_batch_tokens": args.micro_tokens,
                                        "share_prompts": not args.no_share_prompts}})
    trainer = Trainer(cfg)
    batch = make_batch(trainer.dims.vocab_size, args.seqs, args.min_len, args.max_len, prompt_frac=args.prompt_frac,
                       group_size=args.group_size)
    real = sum(len(s.token_ids) for s in batch.sequences)
    metrics: dict = {}

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    hf = resolve_model(args.model).hf_model(torch.float32).to(device).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0)
    meg_times, hf_times = timed_pairs(
        lambda: metrics.update(trainer.train_on(batch)),
        lambda: hf_step(hf, opt, batch.sequences, args.hf_micro, cfg.algo.eps_low, cfg.algo.eps_high,
                        device, dtype),
        args.steps)
    last = metrics

    meg = real / statistics.median(meg_times)
    base = real / statistics.median(hf_times)
    ratio = statistics.median(h / m for m, h in zip(meg_times, hf_times))
    print(f"batch: {args.seqs} sequences, {real} tokens (lengths {args.min_len}-{args.max_len}), "
          f"precision {args.precision}, device {device.type}, torch threads {torch.get_num_threads()}, "
          f"core attention {args.core_attention}")
    print(f"packing: {int(last['n_micro_batches'])} micro-batches of <= {args.micro_tokens} tokens, padding "
          f"{last['padding_fraction']:.1%} (naive padding to the longest: {last['naive_padding_fraction']:.1%}); "
          f"prompts held once: {last['shared_prompt_fraction']:.1%} of the tokens (groups of {args.group_size})")
    print(f"megatron_rl trainer : {meg:8.1f} tok/s  (step times {[round(t, 2) for t in meg_times]})")
    print(f"HF + torch AdamW    : {base:8.1f} tok/s  (step times {[round(t, 2) for t in hf_times]})")
    print(f"ratio megatron_rl / HF: {ratio:.2f}x  (median of per-round ratios; ratio of medians "
          f"{meg / base:.2f}x)")


if __name__ == "__main__":
    main()
