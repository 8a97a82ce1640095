"""Activation recompute: peak memory and tokens/s of the real training step, none vs selective vs full,
as ratios against none, in one run.

    .venv/bin/python benchmarks/recompute.py [--tokens 4096] [--seqs 8] [--layers 4] [--hidden 256]
        [--precision fp32|bf16] [--repeats 2] [--modes none,selective,full]

Each mode runs in a fresh process (`megatron_rl.plan.step_memory`): a Trainer on a random Llama
(GQA 8/2 heads, FFN 2.75 h, vocab 1024), one warm-up `forward_backward` (RL loss, packing, Megatron's
schedule; no optimizer step), then the measured one: peak RSS growth on CPU (the CUDA allocator's
peak on a GPU), then `repeats` more timed steps. The estimate column is
`plan.estimate.activation_memory` (kernels "local" on CPU, "fused" on GPU) plus the logits term.
"""
from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="none,selective,full")
    args = ap.parse_args()

    from megatron_rl.plan.step_memory import bench_estimate, bench_llama, measure

    h = args.hidden
    model, shapes = bench_llama(h, args.layers, args.tokens)
    ffn = shapes.ffn
    rows = {}
    for mode in args.modes.split(","):
        spec = {"model": model, "trainer": {"precision": args.precision, "micro_batch_tokens": args.tokens,
                                            "recompute": mode},
                "seq_lengths": [args.tokens // args.seqs] * args.seqs, "repeats": args.repeats}
        result = measure(spec)
        rows[mode] = (result, bench_estimate(shapes, args.tokens, mode, args.precision))
    base_mem, base_tps = rows["none"][0]["growth_bytes"], rows["none"][0]["tokens_per_s"]
    print(f"model: {args.layers} layers, hidden {h}, ffn {ffn}, GQA 8/2, {args.precision}; one bin of "
          f"{args.tokens} tokens ({args.seqs} sequences); device {rows['none'][0]['device']}")
    print(f"{'recompute':<10} {'peak MB':>9} {'estimate MB':>12} {'peak vs none':>13} {'tokens/s':>9} "
          f"{'tok/s vs none':>14}")
    for mode, (r, est) in rows.items():
        print(f"{mode:<10} {r['growth_bytes'] / 2**20:>9.0f} {est / 2**20:>12.0f} "
              f"{r['growth_bytes'] / base_mem:>13.2f} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base_tps:>14.2f}")


if __name__ == "__main__":
    main()
