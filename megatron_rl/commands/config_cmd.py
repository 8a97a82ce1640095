"""`megatron-rl config [CONFIG] [key=value ...]`: print the fully resolved config as YAML."""
from __future__ import annotations

import argparse
import sys

from megatron_rl.config import ConfigError, dump_config, load_config_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.eps_high=0.26")


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load_config_args(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(dump_config(cfg))
    return 0
