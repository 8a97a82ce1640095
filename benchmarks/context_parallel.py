"""Context parallel: peak memory per rank and tokens/s of the real training step, CP=1 (one process)
vs CP=2 (two gloo processes), as ratios against CP=1, in one run.

    .venv/bin/python benchmarks/context_parallel.py [--tokens 8192] [--seqs 2] [--layers 4] [--hidden 256]
        [--precision fp32|bf16] [--repeats 1] [--cps 1,2] [--recompute none]

The model and the step are benchmarks/recompute.py's (random Llama, GQA 8/2 heads, FFN 2.75 h, vocab
1024; one bin of `seqs` sequences of `tokens / seqs` tokens), measured by `plan.step_memory.measure`
in fresh processes: CP=c runs on c ranks (torchrun, the machine's cores split between them), each
rank's peak RSS growth over one `forward_backward` after a warm-up one (the CUDA allocator's peak on
a GPU); the table shows the largest rank's. tokens/s counts the whole bin once (every CP rank holds
1/c of it) over the slowest rank's step time. The estimate column is what `plan.estimate` counts for
a CP rank: `activation_memory` at micro_batch_tokens / CP (on CPU with the local spec's CP attention,
which keeps the all-gathered K/V of the whole row, `train/cp_attention.py`) plus the fp32 logits and
their gradient for those tokens.
"""
from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cps", default="1,2", help="comma-separated CP sizes; the first is the baseline")
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    args = ap.parse_args()

    from megatron_rl.plan.step_memory import bench_estimate, bench_llama, measure

    h = args.hidden
    model, shapes = bench_llama(h, args.layers, args.tokens)
    ffn = shapes.ffn
    rows = {}
    for cp in map(int, args.cps.split(",")):
        spec = {"model": model, "nproc": cp,
                "trainer": {"precision": args.precision, "micro_batch_tokens": args.tokens,
                            "recompute": args.recompute, "context_parallel": cp},
                "seq_lengths": [args.tokens // args.seqs] * args.seqs, "repeats": args.repeats}
        result = measure(spec)
        # each CP rank holds tokens / CP of every activation and of the logits (as plan.estimate counts it)
        rows[cp] = (result, bench_estimate(shapes, args.tokens // cp, args.recompute, args.precision, cp))
    base, _ = next(iter(rows.values()))
    print(f"model: {args.layers} layers, hidden {h}, ffn {ffn}, GQA 8/2, {args.precision}, recompute "
          f"{args.recompute}; one bin of {args.tokens} tokens ({args.seqs} sequences); device {base['device']}")
    print(f"{'mode':<6} {'peak MB/rank':>12} {'ranks MB':>11} {'estimate MB':>12} {'peak vs CP1':>12} "
          f"{'tokens/s':>9} {'tok/s vs CP1':>13}")
    for cp, (r, est) in rows.items():
        per_rank = "/".join(f"{x['growth_bytes'] / 2**20:.0f}" for x in r.get("ranks", [r]))
        print(f"CP={cp:<3} {r['growth_bytes'] / 2**20:>12.0f} {per_rank:>11} {est / 2**20:>12.0f} "
              f"{r['growth_bytes'] / base['growth_bytes']:>12.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:>13.2f}")
    losses = {cp: round(r["loss"], 5) for cp, (r, _) in rows.items()}
    print(f"step loss by CP (metrics summed over CP ranks: equal when CP is right): {losses}")


if __name__ == "__main__":
    main()
