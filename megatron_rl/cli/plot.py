"""`megatron-rl plot RUN_DIR [RUN_DIR ...] [-o FILE] [--labels ...]`: the curves of one run, or of several
runs on one figure, as PNG (megatron_rl.experiments.plot)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories containing metrics.jsonl")
    parser.add_argument("-o", "--out", help="PNG path (default RUN_DIR/curves.png; required for several runs)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the directory names)")
    parser.add_argument("--metrics", nargs="+",
                        help="draw these metrics, one panel each (a key ending in * draws every key it starts), "
                             "instead of the default panels")
    parser.add_argument("--halflife", type=float,
                        help="smoothing half-life in updates (default: a twentieth of the longest run, at least 1)")


def main(args: argparse.Namespace) -> int:
    from megatron_rl.experiments.plot import plot_runs

    if len(args.run_dirs) > 1 and not args.out:
        print("plot: -o/--out is required when comparing several runs", file=sys.stderr)
        return 2
    if args.halflife is not None and args.halflife <= 0:
        print("plot: --halflife must be > 0", file=sys.stderr)
        return 2
    out = args.out or f"{args.run_dirs[0]}/curves.png"
    try:
        path = plot_runs(args.run_dirs, out, args.labels, args.metrics, args.halflife)
    except (FileNotFoundError, ValueError) as e:
        print(f"plot: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
