"""`megatron-rl config [CONFIG] [key=value ...]`: print the fully resolved config as YAML."""
from __future__ import annotations

import argparse
import sys

from megatron_rl.config import ConfigError, dump_config, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.eps_high=0.26")


def main(args: argparse.Namespace) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # only overrides were given
        overrides.insert(0, config)
        config = None
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(dump_config(cfg))
    return 0
