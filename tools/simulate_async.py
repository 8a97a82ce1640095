"""Discrete-event simulator of the async RL pipeline vs the synchronous baseline (thin CLI).

Same as `megatron-rl simulate ...`; the model lives in megatron_rl/control/simulate.py.

    .venv/bin/python tools/simulate_async.py --generators 8 --n-async 512 --n-batch 256 --n-mini 4 \
        --group 16 --lengths pareto:low=500,ratio=5 --train-a 5 --train-b 2e-4 --push-s 2
"""
from __future__ import annotations

import argparse
import sys

from megatron_rl.commands import simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="simulate_async", description=simulate.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate.add_arguments(parser)
    return simulate.main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
