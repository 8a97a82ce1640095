"""`megatron-rl evaluate --source {jsonl,reasoning_gym,humaneval,champ} --n N --k 1,4 --out results.jsonl`.

Samples N completions per problem (SGLang server for --model, or --samples FILE), grades them with
the project's verifiers, writes one JSONL row per problem (n, correct, pass_rate, language, ...)
and prints pass@1 (mean over the N samples) and unbiased pass@k, overall and per language, as JSON.
Sampling shows completions done, tokens streamed and the time left at most; without a GPU, a run too
large to finish soon is named before it starts, with the flags that make it small.
"""
from __future__ import annotations

import argparse
import json

from megatron_rl.cli.common import (add_config_argument, add_problem_args, add_sampler_args, load_problems, open_sampler,
                                    run_config, sampling_params)
from megatron_rl.log import get_logger

log = get_logger(__name__)
# SGLang's CPU engine at its best: SmolLM2-135M on 2 idle cores, 32-64 requests at once (a busy CPU, or one
# without AVX-512 bf16 whose bf16/fp16 matmuls are ~40x slower than fp32, gives 2-10 tok/s)
CPU_TOK_S = 150
CPU_WARN_S = 600  # a CPU run whose token budget takes longer than this even at CPU_TOK_S gets the warning
QUICK = "--limit 4 --n 4 --k 1,4 --max-new-tokens 128"  # docs/getting_started.md step 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser, required=False, alias=True)  # trainer.model, rollout.* sampling, generator.*
    add_problem_args(parser)
    add_sampler_args(parser)
    parser.add_argument("--n", type=int, default=4, help="samples per problem")
    parser.add_argument("--k", default="1", help="comma-separated k values for pass@k (each <= --n)")
    parser.add_argument("--out", help="per-problem JSONL results (default: not written)")
    parser.add_argument("--summary", help="write the summary JSON here too (default: printed only)")
    parser.epilog = f"Without a GPU keep it small: {QUICK} samples 16 completions of at most 128 tokens."


def main(args: argparse.Namespace) -> int:
    from megatron_rl.data.sources import DataError
    from megatron_rl.data.problem_sets import write_jsonl
    from megatron_rl.evaluation.scoring import grade_samples, summarize
    from megatron_rl.evaluation.sampling import SamplingFailed

    try:
        ks = sorted({int(x) for x in args.k.split(",") if x.strip()})
        if not ks or min(ks) < 1 or max(ks) > args.n:
            raise ValueError(f"--k values must lie in [1, --n={args.n}], got {args.k!r}")
        problems = load_problems(args)
        cfg = run_config(args)
        if not args.samples:  # before the server starts: the size is known now
            _warn_if_slow_on_cpu(len(problems), args.n, sampling_params(args, cfg)["max_new_tokens"])
        sampler, close = open_sampler(args, cfg)
    except (DataError, ValueError, OSError, ImportError, SamplingFailed) as e:
        log.error("%s", e)
        return 1
    try:
        samples = sampler.sample(problems, args.n)
    except (ValueError, SamplingFailed) as e:
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


def _warn_if_slow_on_cpu(n_problems: int, n: int, max_new_tokens: int) -> None:
    from megatron_rl.platform import has_cuda

    budget = n_problems * n * max_new_tokens
    seconds = budget / CPU_TOK_S
    if not has_cuda() and seconds > CPU_WARN_S:
        log.warning("no GPU: up to %d new tokens (%d problems x %d samples x %d); even at %d tok/s that can take "
                    "%.1f h. For a quick check: %s", budget, n_problems, n, max_new_tokens, CPU_TOK_S,
                    seconds / 3600, QUICK)
