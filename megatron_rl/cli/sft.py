"""`megatron-rl sft [CONFIG] --data traces.jsonl [key=value ...]`: supervised cold start.

Trains config.trainer.model on the traces (cross-entropy on completion tokens), logs one JSON line
per optimizer step to `<run.output_dir>/sft_metrics.jsonl` and saves a trainer checkpoint under
`<run.output_dir>/checkpoints` at the end. Launch with torchrun for TP/PP/DP > 1.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_rl.cli.common import add_config_argument
from megatron_rl.config import ConfigError, load_config_args
from megatron_rl.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser, required=False)
    parser.add_argument("--data", required=True, help="JSONL traces (prompt/completion, messages or *_ids)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--epochs", type=int, default=None, help="default: trainer.sft_epochs")
    parser.add_argument("--no-save", action="store_true", help="skip the final checkpoint")


def main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_rl.train.sft import read_jsonl, run_sft, to_sequences, tokenize_record
    from megatron_rl.train.trainer import Trainer

    try:
        cfg = load_config_args(args.config, args.overrides)
        records = read_jsonl(args.data)
    except (ConfigError, ValueError, OSError) as e:
        log.error("%s", e)
        return 1
    trainer = Trainer(cfg)
    from megatron_rl.train.hf_source import resolve_model

    tokenizer = None
    if any("prompt_ids" not in r for r in records):
        tokenizer = resolve_model(cfg.trainer.model).tokenizer()
    seqs, dropped = to_sequences((tokenize_record(r, tokenizer) for r in records), cfg.trainer.micro_batch_tokens)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out = Path(cfg.run.output_dir)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        log.info("%d sequences (%d dropped: prompt longer than micro_batch_tokens)", len(seqs), dropped)
    metrics_file = open(out / "sft_metrics.jsonl", "a") if rank0 else None

    def log_step(m):
        if metrics_file is not None:
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            print(f"sft step {m['step']} epoch {m['epoch']}: loss {m['loss']:.4f} "
                  f"grad_norm {m['grad_norm']:.3f} {m['tokens_per_s']:.0f} tok/s", flush=True)

    epochs = args.epochs if args.epochs is not None else cfg.trainer.sft_epochs
    try:
        run_sft(trainer, seqs, min(args.batch_size, len(seqs)), epochs, seed=cfg.trainer.seed, on_step=log_step)
    finally:
        if metrics_file is not None:
            metrics_file.close()
    if not args.no_save:
        path = trainer.save(out / "checkpoints", extra={"sft": {"data": str(args.data), "epochs": epochs}})
        if rank0:
            print(f"sft: checkpoint {path}", flush=True)
    return 0
