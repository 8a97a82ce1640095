"""`megatron-rl simulate`: discrete-event simulation of the async pipeline vs the synchronous baseline.

    megatron-rl simulate [CONFIG] [key=value ...] --generators 8 --n-async 512 --n-batch 256 --n-mini 4 --group 16 \
        --peak-tok-s 3000 --c-half 32 --train-a 5 --train-b 2e-4 --push-s 2 \
        --lengths pareto:low=500,ratio=5,alpha=1.2 [--calibrate RUN_DIR] [--json out.json]

Prints one table row per mode and the async / sync throughput ratio. A run config (CONFIG and its
overrides) sets the pipeline's shape: generator.num_generators, rollout.n_async, n_batch, n_mini,
group_size, max_staleness and env.extra_in_flight; `--calibrate` then fits the trainer, push and generator rates to
RUN_DIR/metrics.jsonl (with episodes: their turns and tool time too); flags given explicitly win over
both.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megatron_rl.cli.common import add_config_argument
from megatron_rl.config import Config, ConfigError, load_config_args
from megatron_rl.log import get_logger
from megatron_rl.plan.simulate import DecodeModel, SimParams, compare, parse_lengths
from megatron_rl.plan.simulate_calibration import Calibration, calibrate

log = get_logger(__name__)

COLUMNS = [("sequences_per_s", "seq/s", ".3g"), ("tokens_per_s", "tok/s", ".4g"),
           ("generator_util", "gen util", ".1%"), ("trainer_util", "train util", ".1%"),
           ("staleness_mean", "stale mean", ".2f"), ("staleness_p95", "p95", ".1f"),
           ("staleness_max", "max", "d"), ("versions_per_seq_mean", "versions/seq", ".2f"),
           ("dropped_frac", "dropped", ".1%")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, required=False)
    a = p.add_argument
    a("--generators", type=int, default=None, help="generator count (default 1)")
    a("--n-async", type=int, default=None, help="sequences in flight (default 64)")
    a("--n-batch", type=int, default=None, help="sequences per trainer update (default 32)")
    a("--n-mini", type=int, default=None, help="optimizer steps per update (default 4)")
    a("--group", type=int, default=None, help="samples per problem G (default 16)")
    a("--peak-tok-s", type=float, default=None, help="one generator's peak decode tokens/s (default 1000)")
    a("--c-half", type=float, default=None, help="concurrency at half the peak (default 0: constant)")
    a("--decode-table", default=None, help="measured 'c:tok_s,c:tok_s,...' (default: none: peak/c-half)")
    a("--prefill-s", type=float, default=None, help="prefill seconds per sequence (stalls its generator; default 0)")
    a("--train-a", type=float, default=None, help="trainer seconds per update, fixed part (default 0 or --calibrate's)")
    a("--train-b", type=float, default=None, help="trainer seconds per token (default 0 or --calibrate's)")
    a("--train-step-s", type=float, default=None, help="trainer seconds per optimizer step (default 0)")
    a("--push-s", type=float, default=None, help="weight push seconds, generators paused (default 0 or --calibrate's)")
    a("--lengths", default=None, help="completion lengths: constant:N | lognormal:mean=,sigma= | "
                                      "pareto:low=,ratio=,alpha= | uniform:low=,ratio= | empirical:a,b,c "
                                      "(default lognormal:mean=1000,sigma=0.5)")
    a("--turns", type=int, default=None, help="model turns per episode (default 1 or --calibrate's)")
    a("--tool-s", type=float, default=None, help="seconds between two turns off the generator: a tool step "
                                                "(default 0 or --calibrate's)")
    a("--extra-in-flight", type=int, default=None, help="episodes admitted beyond n_async while others are in "
                                                         "tools (env.extra_in_flight; default 0)")
    a("--prompt-len", type=int, default=None, help="prompt tokens per sequence, a trainer cost (default 0)")
    a("--drop-prob", type=float, default=None, help="probability a group is non-diverse (default 0 or --calibrate's)")
    a("--max-staleness", type=int, default=None, help="staleness bound (-1: unbounded; default 4)")
    a("--updates", type=int, default=60, help="trainer updates to simulate")
    a("--warmup", type=int, default=10, help="updates excluded from the figures")
    a("--seed", type=int, default=0)
    a("--calibrate", metavar="RUN_DIR", default=None, help="fit rates to RUN_DIR/metrics.jsonl first (default: none)")
    a("--json", metavar="PATH", default=None, help="also write inputs and results as JSON ('-': stdout; default: none)")


def _decode_table(spec: str) -> list[tuple[float, float]]:
    try:
        return [(float(c), float(t)) for c, t in (item.split(":") for item in spec.split(",") if item.strip())]
    except ValueError:
        raise ValueError(f"--decode-table expects 'c:tok_s,c:tok_s,...', got {spec!r}") from None


def params_of_config(cfg: Config, **rest) -> SimParams:
    """The pipeline shape of a run config (its rates are the simulator's defaults or flags)."""
    r = cfg.rollout
    return SimParams(generators=cfg.generator.num_generators, n_async=r.n_async, n_batch=r.n_batch,
                     n_mini=r.n_mini, group=r.group_size, max_staleness=r.max_staleness,
                     extra_in_flight=cfg.env.extra_in_flight, **rest)


def calibrate_run(run_dir: str | Path, generators: int, n_async: int, **kw: Any) -> Calibration:
    """The calibration of RUN_DIR's metrics.jsonl (or of that file given itself): the run's files are the
    runtime's (control/metrics.py), the fit is the planner's."""
    from megatron_rl.control.metrics import METRICS_FILE, read_jsonl

    path = Path(run_dir)
    path = path if path.is_file() else path / METRICS_FILE
    rows = read_jsonl(path)
    if not rows:
        raise FileNotFoundError(f"no metrics rows in {path}")
    return calibrate(rows, generators, n_async, **kw)


def build_params(args: argparse.Namespace) -> SimParams:
    rest = {"updates": args.updates, "warmup_updates": args.warmup, "seed": args.seed}
    config, overrides = getattr(args, "config", None), getattr(args, "overrides", [])
    p = params_of_config(load_config_args(config, overrides), **rest) if config or overrides else SimParams(**rest)
    if args.calibrate:
        cal = calibrate_run(args.calibrate, args.generators or p.generators, args.n_async or p.n_async,
                            prompt_len=args.prompt_len or 0, c_half=args.c_half or 0.0)
        p = cal.apply(p)
        if cal.mean_length:
            p.lengths = parse_lengths(f"lognormal:mean={cal.mean_length},sigma=0.5")
        log.info("calibrated from %s (%d rows): %s", args.calibrate, cal.rows, asdict(cal))
    direct = {"generators": args.generators, "n_async": args.n_async, "n_batch": args.n_batch,
              "n_mini": args.n_mini, "group": args.group, "prefill_s": args.prefill_s, "train_a_s": args.train_a,
              "train_b_s": args.train_b, "train_step_s": args.train_step_s, "push_s": args.push_s,
              "prompt_len": args.prompt_len, "drop_prob": args.drop_prob, "turns": args.turns, "tool_s": args.tool_s,
              "extra_in_flight": args.extra_in_flight}
    for key, value in direct.items():
        if value is not None:
            setattr(p, key, value)
    if args.max_staleness is not None:
        p.max_staleness = None if args.max_staleness < 0 else args.max_staleness
    if args.lengths:
        p.lengths = parse_lengths(args.lengths)
    if args.decode_table:
        p.decode = DecodeModel(table=_decode_table(args.decode_table))
    elif args.peak_tok_s is not None or args.c_half is not None:
        p.decode = DecodeModel(args.peak_tok_s or p.decode.peak_tok_s,
                               p.decode.c_half if args.c_half is None else args.c_half)
    p.validate()
    return p


def format_table(results: dict) -> str:
    head = f"{'mode':<6}" + "".join(f"{label:>13}" for _, label, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for mode, r in results.items():
        lines.append(f"{mode:<6}" + "".join(f"{format(getattr(r, k), fmt):>13}" for k, _, fmt in COLUMNS))
    a, s = results["async"].sequences_per_s, results["sync"].sequences_per_s
    lines.append(f"async / sync throughput: {a / s:.2f}x")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        params = build_params(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        log.error("%s", e)
        return 2
    results = compare(params)
    print(format_table(results))
    if args.json:
        doc = json.dumps({"params": asdict(params), **{m: r.to_dict() for m, r in results.items()}}, indent=2)
        if args.json == "-":
            print(doc)
        else:
            with open(args.json, "w") as f:
                f.write(doc + "\n")
    return 0
