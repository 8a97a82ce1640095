"""Argument groups and loaders shared by the filter / evaluate / translate commands."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from megatron_rl.records import Problem


def add_problem_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", default="jsonl", choices=["jsonl", "reasoning_gym", "humaneval", "champ"])
    p.add_argument("--path", help="problem JSONL (default: none; required with --source jsonl)")
    p.add_argument("--task", default="basic_arithmetic", help="reasoning-gym task (source reasoning_gym)")
    p.add_argument("--size", type=int, default=100, help="reasoning-gym problems to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="use only the first N problems (default: all)")


def load_problems(args: argparse.Namespace) -> list[Problem]:
    from megatron_rl.data.sources import read_jsonl, reasoning_gym_problems

    if args.source == "jsonl":
        if not args.path:
            raise ValueError("--path is required with --source jsonl")
        problems = read_jsonl(args.path)
    elif args.source == "reasoning_gym":
        problems = reasoning_gym_problems(args.task, args.size, args.seed)
    elif args.source == "humaneval":
        from megatron_rl.data.humaneval import humaneval_problems

        problems = humaneval_problems()
    else:
        from megatron_rl.data.champ import champ_problems

        problems = champ_problems()
    return problems[: args.limit] if args.limit is not None else problems


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
    return {"temperature": args.temperature if args.temperature is not None else cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p, "max_new_tokens": args.max_new_tokens or cfg.rollout.max_new_tokens}


def open_sampler(args: argparse.Namespace, cfg=None):
    """(sampler, closer) from --samples or an SGLang server started for the configured model."""
    from megatron_rl.rollout.server import ServerStartError

    from .sampling import FileSampler, GeneratorSampler, SamplingFailed, open_generator

    if args.samples:
        return FileSampler(args.samples), (lambda: None)
    cfg = cfg or run_config(args)
    model = args.model or cfg.trainer.model
    try:
        gen = open_generator(model, args.port or cfg.generator.port_base, cfg.rollout, cfg.generator)
    except ServerStartError as e:
        raise SamplingFailed(str(e)) from e
    from megatron_rl.train.hf_source import resolve_model

    tokenizer = resolve_model(model).tokenizer()
    sampler = GeneratorSampler(gen, tokenizer, args.template or cfg.data.system_prompt, sampling_params(args, cfg))
    return sampler, gen.close


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    from megatron_rl.data.sources import utf8_lines

    rows = []
    for lineno, line in utf8_lines(Path(path)):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
    return rows
