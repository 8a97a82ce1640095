"""`megatron-rl evaluate --source {jsonl,reasoning_gym,humaneval,champ} --n N --k 1,4 --out results.jsonl`.

Samples N completions per problem (SGLang server for --model, or --samples FILE), grades them with
the project's verifiers, writes one JSONL row per problem (n, correct, pass_rate, language, ...)
and prints pass@1 (mean over the N samples) and unbiased pass@k, overall and per language, as JSON.
"""
from __future__ import annotations

import argparse
import json

from megatron_rl.commands.common import add_config_argument
from megatron_rl.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_rl.tools.cli_common import add_problem_args, add_sampler_args

    add_config_argument(parser, required=False, alias=True)  # trainer.model, rollout.* sampling, generator.*
    add_problem_args(parser)
    add_sampler_args(parser)
    parser.add_argument("--n", type=int, default=4, help="samples per problem")
    parser.add_argument("--k", default="1", help="comma-separated k values for pass@k (each <= --n)")
    parser.add_argument("--out", help="per-problem JSONL results")
    parser.add_argument("--summary", help="write the summary JSON here too")


def main(args: argparse.Namespace) -> int:
    from megatron_rl.data.sources import DataError
    from megatron_rl.tools.cli_common import load_problems, open_sampler, write_jsonl
    from megatron_rl.tools.evaluate import grade_samples, summarize

    try:
        ks = sorted({int(x) for x in args.k.split(",") if x.strip()})
        if not ks or min(ks) < 1 or max(ks) > args.n:
            raise ValueError(f"--k values must lie in [1, --n={args.n}], got {args.k!r}")
        problems = load_problems(args)
        sampler, close = open_sampler(args)
    except (DataError, ValueError, OSError, ImportError) as e:
        log.error("%s", e)
        return 1
    try:
        samples = sampler.sample(problems, args.n)
    except ValueError as e:
        log.error("%s", e)
        return 1
    finally:
        close()
    rows = grade_samples(problems, samples, workers=args.workers)
    summary = summarize(rows, ks)
    if args.out:
        write_jsonl(args.out, [r.to_dict() for r in rows])
    text = json.dumps(summary, indent=2)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
