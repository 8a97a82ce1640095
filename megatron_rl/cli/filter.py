"""`megatron-rl filter format IN OUT` / `megatron-rl filter difficulty --path IN OUT --k 16 ...`.

format: drop proofs, multi-part and unverifiable problems, turn multiple choice into open answers;
prints the counts of what was dropped and why. difficulty: one stage of the pass-rate band filter
(sample k per problem, keep min_pass <= pass rate <= max_pass); writes the kept problems with their
pass rates (and `--all-out` every problem's rate).
"""
from __future__ import annotations

import argparse
import json

from megatron_rl.cli.common import add_config_argument, add_problem_args, add_sampler_args, load_problems, open_sampler
from megatron_rl.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    f = sub.add_parser("format", help="format filtering of a raw problem JSONL")
    f.add_argument("input", help="JSONL rows {id?, problem|prompt, answer, choices?}")
    f.add_argument("out", help="kept problems (JSONL, readable by data.source=jsonl)")
    f.add_argument("--report", help="write the counts (JSON) here too (default: printed only)")
    d = sub.add_parser("difficulty", help="one stage of pass-rate band filtering",
                       description="one stage of pass-rate band filtering; the optional CONFIG gives trainer.model, "
                                   "rollout.* sampling and generator.*, and key=value overrides may follow anywhere")
    add_config_argument(d, required=False, overrides=False, alias=True)
    add_problem_args(d)
    add_sampler_args(d)
    d.add_argument("out", help="kept problems with pass_rate (JSONL)")
    d.add_argument("--k", type=int, default=16, help="samples per problem")
    d.add_argument("--min-pass", type=float, default=0.01, help="keep pass rate >= this (drops never solved)")
    d.add_argument("--max-pass", type=float, default=0.99, help="keep pass rate <= this (drops always solved)")
    d.add_argument("--stage", type=int, default=1, help="stage label written to each row")
    d.add_argument("--all-out", help="every problem with its pass rate (JSONL; default: not written)")


def _format(args) -> int:
    from megatron_rl.data.problem_sets import read_rows, write_jsonl
    from megatron_rl.data.filter_format import format_filter

    try:
        rows = read_rows(args.input)
    except (OSError, ValueError) as e:
        log.error("%s", e)
        return 1
    report = format_filter(rows)
    write_jsonl(args.out, report.kept)
    summary = report.summary() | {"examples": report.examples}
    if args.report:
        with open(args.report, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    return 0


def _difficulty(args) -> int:
    from megatron_rl.data.sources import DataError
    from megatron_rl.data.problem_sets import write_jsonl
    from megatron_rl.data.filter_difficulty import difficulty_filter
    from megatron_rl.evaluation.sampling import SamplingFailed

    try:
        problems = load_problems(args)
        sampler, close = open_sampler(args)
    except (DataError, ValueError, OSError, ImportError, SamplingFailed) as e:
        log.error("%s", e)
        return 1
    try:
        report = difficulty_filter(problems, sampler, args.k, args.min_pass, args.max_pass, args.stage,
                                   workers=args.workers)
    except (ValueError, SamplingFailed) as e:
        log.error("%s", e)
        return 1
    finally:
        close()
    write_jsonl(args.out, report.kept)
    if args.all_out:
        write_jsonl(args.all_out, report.all_rows)
    print(json.dumps(report.summary(), indent=2))
    return 0


def main(args: argparse.Namespace) -> int:
    return _format(args) if args.kind == "format" else _difficulty(args)
