"""What the `megatron-rl` subcommands share on their command lines: the config argument convention,
`key=value` overrides anywhere after the command, the help formatter that shows defaults, the
options every command takes (`--log-level`, `--quiet`), and the problem-set and sampler options of
evaluate / filter / translate (their library side: data/problem_sets.py, evaluation/sampling.py).

The convention: a command that reads the run config takes it as its first positional argument
`CONFIG` (optional where the defaults make sense), and dotted overrides such as `run.updates=30` may
stand anywhere after the command name, before or after its options. `--config PATH` is still accepted,
with a warning, by the commands that used to take it (reward, evaluate, filter difficulty).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import sys
from functools import lru_cache
from pathlib import Path


def _shows(default) -> bool:
    """A default worth printing: not None, an off flag, SUPPRESS or an empty list (0 and 0.0 are)."""
    return not (default is None or default is False or default is argparse.SUPPRESS or default == [])


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: X)` after each option's help, except where there is nothing to show (no default, a flag
    off by default) or the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not _shows(default) or "default" in text.lower() or text == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def show_defaults_without_help(parser: argparse.ArgumentParser) -> None:
    """argparse prints nothing for an option without help text, not even its default: give those a help
    that is their default."""
    for action in parser._actions:
        if action.help is None and _shows(action.default):
            action.help = "default: %(default)s"


def add_config_argument(parser: argparse.ArgumentParser, *, required: bool, overrides: bool = True,
                        alias: bool = False) -> None:
    """The run config as the first positional `CONFIG`, and the positional overrides (listed in the
    usage; `split_overrides` hands them over wherever they stood)."""
    parser.add_argument("config", metavar="CONFIG", nargs=None if required else "?",
                        help="YAML run config" if required else "YAML run config (the defaults when omitted)")
    if alias:
        parser.add_argument("--config", dest="config_option", metavar="CONFIG",
                            help="deprecated spelling of the positional CONFIG (default: none)")
    if overrides:
        parser.add_argument("overrides", nargs="*", metavar="key=value",
                            help="dotted config overrides, anywhere after the command, e.g. run.updates=30")
    else:
        parser.set_defaults(overrides=[])


@lru_cache(maxsize=1)
def _override_pattern() -> re.Pattern:
    from megatron_rl.config import Config

    sections = "|".join(f.name for f in dataclasses.fields(Config))
    return re.compile(rf"^(?:{sections})\.[A-Za-z_][\w.]*=")


def is_override(token: str) -> bool:
    """`section.key=value` with a real config section (so an option's value such as
    `pareto:low=500` or a path with `=` in it is never taken for one)."""
    return bool(_override_pattern().match(token))


def split_overrides(argv: list[str], commands: set[str]) -> tuple[list[str], list[str]]:
    """(argv without the overrides that follow the command name, those overrides in order)."""
    at = next((i for i, token in enumerate(argv) if token in commands), None)
    if at is None:
        return list(argv), []
    rest, overrides = [], []
    for i, token in enumerate(argv):
        if i > at and token != "--" and is_override(token):
            overrides.append(token)
        else:
            rest.append(token)
    return rest, overrides


def add_common_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """--log-level and --quiet on the top parser and on every leaf subcommand (so either place works)."""
    default = None if top else argparse.SUPPRESS  # a leaf's absent flag must not undo the top one's
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
                        default=default, help="log level (default: $MEGATRON_RL_LOG_LEVEL, else INFO)")
    parser.add_argument("-q", "--quiet", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="no progress bars (they are also off when stderr is not a terminal)")


def leaf_parsers(parser: argparse.ArgumentParser):
    """Every parser of the tree, leaves last-level included (for shared options and the formatter)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from leaf_parsers(sub)


def has_subcommands(parser: argparse.ArgumentParser) -> bool:
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def venv_tool(name: str) -> str | None:
    """A program of this Python's environment (next to sys.executable: the mpich wheel's mpiexec, found
    whether or not the venv is activated), else the one on PATH; None when neither exists."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def add_problem_args(p: argparse.ArgumentParser) -> None:
    from megatron_rl.data.problem_sets import SOURCES

    p.add_argument("--source", default="jsonl", choices=list(SOURCES))
    p.add_argument("--path", help="problem JSONL (default: none; required with --source jsonl)")
    p.add_argument("--task", default="basic_arithmetic", help="reasoning-gym task (source reasoning_gym)")
    p.add_argument("--size", type=int, default=100, help="reasoning-gym problems to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="use only the first N problems (default: all)")


def load_problems(args: argparse.Namespace):
    """The problem set that add_problem_args' options name."""
    from megatron_rl.data.problem_sets import load_problem_set

    return load_problem_set(args.source, args.path, args.task, args.size, args.seed, args.limit)


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    from megatron_rl.config import RolloutConfig

    rollout = RolloutConfig()  # the sampling defaults a config without a rollout section gives
    p.add_argument("--samples", help="JSONL of {problem_id, response} completions made elsewhere "
                                     "(default: none, sample with an SGLang server)")
    p.add_argument("--model", help="model to sample from (default: the config's trainer.model)")
    p.add_argument("--template", default=None, help="system-prompt template (default: data.system_prompt)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"longest completion (default: rollout.max_new_tokens, {rollout.max_new_tokens}); "
                        "the time of a run grows with it: on a CPU keep it to a few hundred")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature (default: rollout.temperature, {rollout.temperature:g})")
    p.add_argument("--port", type=int, default=None, help="SGLang port (default: generator.port_base)")
    p.add_argument("--workers", type=int, default=2, help="grading processes")


def run_config(args: argparse.Namespace):
    """The config of CONFIG and its overrides (trainer.model, rollout.*, generator.*, data.system_prompt),
    with the checks that run code (the prompt template exists, reward.custom loads) as `train` runs them."""
    from megatron_rl.config import load_config
    from megatron_rl.control.preflight import check_config

    cfg = load_config(args.config, getattr(args, "overrides", []))
    check_config(cfg)
    return cfg


def sampling_params(args: argparse.Namespace, cfg) -> dict:
    """SGLang sampling parameters: the flags, else the config's rollout section."""
    from megatron_rl.evaluation.sampling import sampling_params as params

    return params(cfg.rollout, args.temperature, args.max_new_tokens)


def open_sampler(args: argparse.Namespace, cfg=None):
    """(sampler, closer) from --samples or an SGLang server started for the configured model."""
    from megatron_rl.evaluation.sampling import FileSampler, open_server_sampler

    if args.samples:
        return FileSampler(args.samples), (lambda: None)
    cfg = cfg or run_config(args)
    return open_server_sampler(cfg, args.model, args.port, args.template, sampling_params(args, cfg))
