"""`megatron-rl estimate CONFIG [--cluster CLUSTER.yaml] [key=value ...]`: per-GPU memory per role
(trainer, generator) and a throughput estimate; exit status 3 when a role does not fit in memory."""
from __future__ import annotations

import argparse
import json

from megatron_rl.cli.common import add_config_argument
from megatron_rl.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser, required=True)
    parser.add_argument("--cluster", help="YAML of megatron_rl.plan.estimate.Cluster (GPU memory, bandwidth, ...); the generator TP is the "
                        "config's generator.tp_size (a generator_tp here must agree with it); default: 80 GB H100s, "
                        "8 per node")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def main(args: argparse.Namespace) -> int:
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.plan.estimate import Cluster, estimate, render, shapes_of

    try:
        cfg = load_config(args.config, args.overrides)
        e = estimate(cfg, Cluster.load(args.cluster), shapes_of(cfg))
    except (ConfigError, ValueError, OSError, TypeError) as err:
        log.error("%s", err)
        return 1
    print(json.dumps(e.to_dict(), indent=2) if args.json else render(e, cfg))
    return 0 if e.fits else 3
