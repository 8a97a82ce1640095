"""`megatron-rl translate --path IN.jsonl OUT.jsonl --base-url http://127.0.0.1:30000 --fraction 0.1`.

Translates a fraction of a problem set through any OpenAI-compatible `/v1/chat/completions`
endpoint, keeps answers untouched, rejects (and counts) translations whose detected language is
wrong; prints the counts as JSON. See megatron_rl.data.translate.

Failed requests are retried (`--retries`, exponential backoff from `--backoff` seconds); translations
are saved as they arrive in OUT.partial.jsonl, so a rerun of the same command after a failure sends
only the requests still missing. The partial file is removed once OUT is written.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_rl.cli.common import add_problem_args, load_problems
from megatron_rl.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_problem_args(parser)
    parser.add_argument("out", help="output problem JSONL")
    parser.add_argument("--base-url", required=True, help="endpoint base, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model", default="default", help="model name sent to the endpoint")
    parser.add_argument("--api-key", default=None, help="bearer token (default: none)")
    parser.add_argument("--fraction", type=float, default=0.1,
                        help="fraction of problems to translate (at least one when above 0)")
    parser.add_argument("--languages", default="fr,es,it,de,zh,ru", help="comma-separated ISO codes")
    parser.add_argument("--mode", choices=["add", "replace"], default="add")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--parallel", type=int, default=4, help="concurrent requests")
    parser.add_argument("--retries", type=int, default=5,
                        help="retries of a request that failed for a reason that may pass (connection, timeout, "
                             "HTTP 408/429/5xx)")
    parser.add_argument("--backoff", type=float, default=1.0,
                        help="seconds before the first retry, doubled for each next one (at most 60)")
    parser.add_argument("--report", help="write the counts and the first rejections (JSON) here too (default: printed only)")


def main(args: argparse.Namespace) -> int:
    from megatron_rl.data.sources import DataError
    from megatron_rl.data.problem_sets import write_jsonl
    from megatron_rl.data.filter_difficulty import problem_row
    from megatron_rl.data.translate import ChatClient, EndpointError, translate_problems

    out = Path(args.out)
    partial = out.with_name(out.name + ".partial.jsonl")
    try:
        problems = load_problems(args)
        client = ChatClient(args.base_url, args.model, args.api_key, max_tokens=args.max_tokens,
                            retries=args.retries, backoff_s=args.backoff)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = translate_problems(problems, client, args.fraction,
                                    [l.strip() for l in args.languages.split(",") if l.strip()],
                                    seed=args.seed, mode=args.mode, workers=args.parallel, partial=partial)
    except (DataError, ValueError, OSError, EndpointError) as e:
        log.error("%s", e)
        if partial.is_file():
            log.error("the translations received so far are in %s: run the same command again to resume", partial)
        return 1
    write_jsonl(out, [problem_row(p) for p in report.problems])
    partial.unlink(missing_ok=True)
    summary = report.summary()
    if args.report:
        with open(args.report, "w") as f:
            json.dump(summary | {"rejections": report.rejections}, f, indent=2, ensure_ascii=False)
    print(json.dumps(summary, indent=2))
    return 0
