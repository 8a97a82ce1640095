"""`megatron-rl reward --task task.json --response response.txt`: grade one response, print JSON.

The task file holds one task dict (schema: megatron_rl.reward.types); the response file is the raw
completion text (`-` reads stdin). Reward numbers come from the config (`--config`, dotted
overrides such as `reward.l_max=2048`). Exit status 0 when graded, 1 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", required=True, help="JSON file with the task dict")
    parser.add_argument("--response", required=True, help="text file with the response ('-' = stdin)")
    parser.add_argument("--num-tokens", type=int, default=None,
                        help="response length in tokens for the overlong penalty (default: estimated)")
    parser.add_argument("--config", default=None, help="YAML config file (its reward section is used)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.l_max=2048")


def main(args: argparse.Namespace) -> int:
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.reward import TaskError, score

    try:
        cfg = load_config(args.config, args.overrides)
        task = json.loads(Path(args.task).read_text(encoding="utf-8"))
        response = sys.stdin.read() if args.response == "-" else Path(args.response).read_text(encoding="utf-8")
        result = score(task, response, cfg.reward, num_tokens=args.num_tokens)
    except (ConfigError, TaskError, OSError, json.JSONDecodeError, ValueError) as e:
        print(f"megatron-rl reward: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    return 0
