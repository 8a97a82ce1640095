"""`megatron-rl` command line: one subcommand per job, each implemented in megatron_rl/commands/.

Subcommands whose issue has not landed yet are listed with the issue that brings them and exit
with status 2 when called; they never pretend to work.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    help: str
    module: str | None = None  # megatron_rl.commands.<module> with add_arguments() and main(args)
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
    "config": Command("print the resolved config (defaults, YAML file and overrides)", module="config_cmd"),
    "doctor": Command("report the environment: versions, devices, CPU shims, sandbox", module="doctor"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl",
        description="Asynchronous RL with verifiable rewards on Megatron-Core and SGLang.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        label = cmd.help if cmd.module else f"{cmd.help} [not yet available: issue #{cmd.issue}]"
        p = sub.add_parser(name, help=label, description=label)
        if cmd.module:
            importlib.import_module(f"megatron_rl.commands.{cmd.module}").add_arguments(p)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    cmd = COMMANDS[args.command]
    if cmd.module is None:
        print(f"megatron-rl {args.command}: not available yet; it arrives with issue #{cmd.issue}.",
              file=sys.stderr)
        return 2
    return int(importlib.import_module(f"megatron_rl.commands.{cmd.module}").main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
