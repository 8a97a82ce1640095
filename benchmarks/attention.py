"""Core attention on one packed bin: megatron_rl's SegmentCausalAttention (on CUDA with bf16: one
torch varlen_attn call for the bin; else per-segment causal SDPA), the same module forced to its
per-segment SDPA loop, and Megatron-Core's DotProductAttention (full bin x bin float32 scores +
block-diagonal mask), in one run.

    .venv/bin/python benchmarks/attention.py [--bin 1024] [--min-len 64] [--max-len 256]
        [--heads 9] [--groups 3] [--head-dim 64] [--precision fp32|bf16] [--rounds 5]

Default shapes are SmolLM2-135M's (9 heads, 3 KV groups, head dim 64) on the trainer benchmark's
bins. One timed call is forward + backward of sum(out * w) on random q/k/v; the modules alternate
(order rotated every round) and the printed ratios are medians of per-round ratios.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _segments(bin_tokens: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Random lengths in [lo, hi] filling the bin; the rest is one padding segment, as packing does."""
    g = torch.Generator().manual_seed(seed)
    out, used = [], 0
    while True:
        n = int(torch.randint(lo, hi + 1, (), generator=g))
        if used + n > bin_tokens:
            break
        out.append(n)
        used += n
    if used < bin_tokens:
        out.append(bin_tokens - used)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=int, default=1024)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.train.attention import SegmentCausalAttention
    from megatron_rl.train.parallel import ParallelLayout, destroy_parallel, init_parallel

    layout = init_parallel(ParallelLayout(), backend="gloo")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=args.heads * args.head_dim, num_attention_heads=args.heads,
        num_query_groups=args.groups, kv_channels=args.head_dim, attention_dropout=0.0, hidden_dropout=0.0,
        masked_softmax_fusion=False, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_cpu_initialization=device.type == "cpu")
    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ours, loop, ref = SegmentCausalAttention(**kw), SegmentCausalAttention(**kw), DotProductAttention(**kw)
    loop.varlen = False  # the per-segment SDPA loop (what CPU, fp32 and CP run)
    fast = ours.varlen and device.type == "cuda" and dtype != torch.float32

    lengths = _segments(args.bin, args.min_len, args.max_len)
    t = args.bin
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    mask = ~((seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool, device=device).tril())
    mask = mask[None, None]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, 1, args.heads, args.head_dim, generator=g).to(device, dtype)
    k = torch.randn(t, 1, args.groups, args.head_dim, generator=g).to(device, dtype)
    v = torch.randn(t, 1, args.groups, args.head_dim, generator=g).to(device, dtype)
    w = torch.randn(t, 1, args.heads * args.head_dim, generator=g).to(device, dtype)

    def step(module, thd: bool):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if thd:
            out = module(*(x.squeeze(1) for x in leaves), None, packed_seq_params=params).view_as(w)
        else:
            out = module(*leaves, mask)
        (out * w).float().sum().backward()
        return out.detach()

    # same result first (the tests check this to 1e-6; here just a sanity line)
    diff = (step(ours, True).float() - step(ref, False).float()).abs().max().item()
    diff_loop = (step(ours, True).float() - step(loop, True).float()).abs().max().item()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    t_ours, t_loop, t_ref = [], [], []
    runs = [(t_ours, lambda: step(ours, True)), (t_loop, lambda: step(loop, True)), (t_ref, lambda: step(ref, False))]
    for i in range(args.rounds):
        for acc, fn in runs[i % 3:] + runs[:i % 3]:
            acc.append(timed(fn))
    ratio = statistics.median(r / o for o, r in zip(t_ours, t_ref))
    ratio_loop = statistics.median(lp / o for o, lp in zip(t_ours, t_loop))
    work = sum(n * n for n in lengths) / (t * t)
    print(f"bin {t} tokens, {len(lengths)} segments (lengths {lengths}), {args.heads} heads / {args.groups} "
          f"groups x {args.head_dim}, {args.precision}, device {device.type}, threads {torch.get_num_threads()}")
    print(f"score work sum(L^2) / T^2 = {work:.3f}; max |difference| of outputs {diff:.2e} "
          f"(vs the loop {diff_loop:.2e})")
    print(f"SegmentCausalAttention fwd+bwd: {statistics.median(t_ours) * 1e3:8.2f} ms "
          f"({'one varlen_attn call' if fast else 'per-segment SDPA: ' + str(ours.varlen_unusable_reason or 'CPU/fp32')})")
    print(f"  per-segment SDPA loop fwd+bwd: {statistics.median(t_loop) * 1e3:8.2f} ms "
          f"(loop / SegmentCausalAttention: {ratio_loop:.2f}x)")
    print(f"DotProductAttention    fwd+bwd: {statistics.median(t_ref) * 1e3:8.2f} ms")
    print(f"speed-up SegmentCausalAttention / DotProductAttention: {ratio:.2f}x (median of per-round ratios)")
    destroy_parallel(destroy_process_group=True)
    del layout


if __name__ == "__main__":
    main()
