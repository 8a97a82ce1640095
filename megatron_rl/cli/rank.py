"""The command line of every MPI rank of a training job:

    mpiexec -n N python -m megatron_rl.cli.rank CONFIG [key=value ...] [--resume]

`megatron-rl train` starts it so when it is not already running inside an MPI job (under mpiexec or
srun, `megatron-rl train` itself is the rank: it calls the same `control.main.run_rank`). It is no
subcommand: users start `megatron-rl train`.
"""
from __future__ import annotations

import argparse
import sys

PROG = "megatron_rl.cli.rank"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--resume", action="store_true", help="= run.resume=require")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.control.main import run_rank

    args = parse_args(argv)
    return run_rank(args.config, args.overrides, args.resume)


if __name__ == "__main__":
    sys.exit(main())
