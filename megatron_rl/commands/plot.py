"""`megatron-rl plot RUN_DIR [--out FILE]`: write the curves of a run to PNG."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory containing metrics.jsonl")
    parser.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")


def main(args: argparse.Namespace) -> int:
    from megatron_rl.control.plot import plot_run

    try:
        path = plot_run(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"plot: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
