"""`megatron-rl reward [CONFIG] --task task.json --response response.txt [key=value ...]`: grade one
response, print the reward breakdown as JSON.

The task file holds one task dict (schema: megatron_rl.reward.types); the response file is the raw
completion text (`-` reads stdin). Reward numbers come from the config (CONFIG, dotted overrides such
as `reward.l_max=2048`). The response's length for the overlong penalty is counted with the tokenizer
of the config's `trainer.model`, as the run counts it (`--num-tokens` gives it instead). The response
is graded as a run grades it, in a verifier-pool worker: a `reward.custom` plug-in that raises or
returns no breakdown gets status "error", one that hangs past `reward.verifier_item_timeout_s`
"timeout", one that dies "crash" (docs/reward.md, "Add a verifier"). Exit status: 0 graded, 1 bad
input, 3 grading failed (no verdict: the printed breakdown's status and error say why).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_rl.cli.common import add_config_argument
from megatron_rl.log import get_logger

log = get_logger(__name__)
GRADING_FAILED = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser, required=False, alias=True)
    parser.add_argument("--task", required=True, help="JSON file with the task dict")
    parser.add_argument("--response", required=True, help="text file with the response ('-' = stdin)")
    parser.add_argument("--num-tokens", type=int, default=None,
                        help="response length in tokens for the overlong penalty (default: counted with "
                             "the tokenizer of the config's trainer.model)")


def count_tokens(model: str, response: str) -> int:
    """Completion tokens of `response` under `model`'s tokenizer (no special tokens: the run counts
    the generated ids, which carry none before the end-of-sequence)."""
    from megatron_rl.train.hf_source import resolve_model

    tokenizer = resolve_model(model).tokenizer()
    return len(tokenizer(response, add_special_tokens=False)["input_ids"])


def grade(cfg, task: dict, response: str, num_tokens: int):
    """The breakdown a run's verifier pool would give (one worker); TaskError / ValueError on bad input."""
    from megatron_rl.reward import VerifierPool, parse_task
    from megatron_rl.reward.compose import penalty_window

    parse_task(task)  # bad input fails here, before a worker starts (and without the pool's "item 0")
    penalty_window(cfg.reward)
    with VerifierPool(cfg.reward, workers=1) as pool:
        return pool.map([(task, response, num_tokens)])[0]


def main(args: argparse.Namespace) -> int:
    from megatron_rl.config import ConfigError, load_config_args
    from megatron_rl.control.preflight import check_config
    from megatron_rl.reward import TaskError

    try:
        cfg = load_config_args(args.config, args.overrides)
        check_config(cfg)  # reward.custom loads here (and the rest pre-flight checks by running code)
        task = json.loads(Path(args.task).read_text(encoding="utf-8"))
        response = sys.stdin.read() if args.response == "-" else Path(args.response).read_text(encoding="utf-8")
        num_tokens = args.num_tokens if args.num_tokens is not None else count_tokens(cfg.trainer.model, response)
        result = grade(cfg, task, response, num_tokens)
    except (ConfigError, TaskError, OSError, json.JSONDecodeError, ValueError) as e:
        log.error("%s: %s", type(e).__name__, e)
        return 1
    print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    if result.grading_failed:
        log.error("grading failed (status %s): %s", result.status, result.error or "no verdict")
        return GRADING_FAILED
    return 0
