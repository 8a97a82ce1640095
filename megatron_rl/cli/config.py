"""`megatron-rl config [CONFIG] [key=value ...]`: print the fully resolved config as YAML."""
from __future__ import annotations

import argparse
import sys

from megatron_rl.cli.common import add_config_argument
from megatron_rl.config import ConfigError, dump_config, load_config_args
from megatron_rl.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser, required=False)


def main(args: argparse.Namespace) -> int:
    from megatron_rl.control.preflight import check_config

    try:
        cfg = load_config_args(args.config, args.overrides)
        check_config(cfg)  # the keys only running code can check: a plug-in that loads, a template that exists
    except ConfigError as e:
        log.error("config error: %s", e)
        return 1
    sys.stdout.write(dump_config(cfg))
    return 0
