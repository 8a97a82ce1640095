"""`megatron-rl` command line: one subcommand per job, each in a module of this package (cli/<module>.py:
`add_arguments(parser)` and `main(args)`). This package is the one layer that parses arguments: the
library code it calls takes typed parameters. Beside the subcommands: `rank` (the entry of every MPI
rank of a training job, which `megatron-rl train` starts under mpiexec) and `logprobs_eval` (the
torchrun script tools/logprobs_eval.py).

Subcommands whose issue has not landed yet are listed with the issue that brings them and exit
with status 2 when called; they never pretend to work.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    help: str
    module: str | None = None  # megatron_rl.cli.<module> with add_arguments() and main(args)
    issue: int | None = None  # open issue that brings the command, while module is None


COMMANDS: dict[str, Command] = {
    "train": Command("run the asynchronous RL loop from a YAML config", module="train"),
    "sft": Command("supervised cold start on reasoning traces (trainer only)", module="sft"),
    "reward": Command("grade one response for a task and print the reward breakdown as JSON", module="reward"),
    "convert": Command("convert checkpoints between Hugging Face and Megatron formats", module="convert"),
    "filter": Command("difficulty and format filtering of problem sets", module="filter"),
    "evaluate": Command("pass@1 / pass@k evaluation on problem sets", module="evaluate"),
    "translate": Command("translate a fraction of a problem set through an OpenAI-compatible endpoint",
                         module="translate"),
    "estimate": Command("per-GPU memory per role and throughput estimate of a config", module="estimate"),
    "plan": Command("rank map of a run on N nodes: roles, GPUs, per-GPU memory, srun task count", module="plan"),
    "plot": Command("plot the metrics of a run directory to PNG", module="plot"),
    "simulate": Command("discrete-event simulation of the async pipeline at scale", module="simulate"),
    "experiment": Command("run an ablation experiment's arms x seeds, then its table and figure",
                          module="experiment"),
    "config": Command("print the resolved config (defaults, YAML file and overrides)", module="config"),
    "doctor": Command("report the environment: versions, devices, CPU shims, sandbox", module="doctor"),
}


def build_parser() -> argparse.ArgumentParser:
    from megatron_rl.cli.common import (DefaultsHelpFormatter, add_common_options, has_subcommands, leaf_parsers,
                                             show_defaults_without_help)

    parser = argparse.ArgumentParser(
        prog="megatron-rl", formatter_class=DefaultsHelpFormatter,
        description="Asynchronous RL with verifiable rewards on Megatron-Core and SGLang.",
        epilog="A command that reads the run config takes it as its first argument CONFIG; dotted overrides "
               "(key=value, e.g. run.updates=30) may stand anywhere after the command.")
    add_common_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        label = cmd.help if cmd.module else f"{cmd.help} [not yet available: issue #{cmd.issue}]"
        p = sub.add_parser(name, help=label, description=label)
        if cmd.module:
            importlib.import_module(f"megatron_rl.cli.{cmd.module}").add_arguments(p)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    for p in leaf_parsers(parser):
        p.formatter_class = DefaultsHelpFormatter
        show_defaults_without_help(p)
        if p is not parser and not has_subcommands(p):
            add_common_options(p, top=False)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; `key=value` overrides may stand anywhere after the command name."""
    from megatron_rl.cli.common import split_overrides

    parser = build_parser()
    rest, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv), set(COMMANDS))
    args = parser.parse_args(rest)
    if overrides and not hasattr(args, "overrides"):
        parser.error(f"{args.command} takes no key=value overrides: {' '.join(overrides)}")
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *overrides]
    args.parser = parser
    return args


def main(argv: list[str] | None = None) -> int:
    from megatron_rl import log

    args = parse(argv)
    if not args.command:
        args.parser.print_help()
        return 0
    log.setup(args.command, _rank_of_job(), args.log_level)
    if args.quiet:
        os.environ["MEGATRON_RL_QUIET"] = "1"  # progress bars off here and in the processes it starts
    config_option = getattr(args, "config_option", None)
    if config_option is not None:
        if args.config is not None:
            args.parser.error(f"{args.command}: give the config once (CONFIG or --config), not both")
        log.get_logger(__name__).warning("--config is deprecated: give the config as the first argument, "
                                         "megatron-rl %s CONFIG ...", args.command)
        args.config = config_option
    cmd = COMMANDS[args.command]
    if cmd.module is None:
        log.get_logger(__name__).error("not available yet; it arrives with issue #%s", cmd.issue)
        return 2
    return int(importlib.import_module(f"megatron_rl.cli.{cmd.module}").main(args) or 0)


def _rank_of_job() -> int | None:
    """This process's rank under torchrun / mpiexec / srun (convert, sft), None in a plain process."""
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None

