"""The command line of tools/logprobs_eval.py, a torchrun script (no `megatron-rl` subcommand):
forward-only logprob evaluation of traces under trainer.model (launch with torchrun for TP/PP/DP).

    python -m torch.distributed.run --nproc_per_node=2 tools/logprobs_eval.py --data traces.jsonl \
        [CONFIG] trainer.tensor_parallel=2

Tokenises the traces like `megatron-rl sft`, runs `Trainer.evaluate(objective="sft")` (the training
schedule, no update) and writes the metrics (mean completion-token NLL as `loss`) as JSON to
<run.output_dir>/logprobs_eval.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DESCRIPTION = "Forward-only logprob evaluation of traces under trainer.model (launch with torchrun for TP/PP/DP)."


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from megatron_rl.config import ConfigError, load_config_args
    from megatron_rl.train.hf_source import resolve_model
    from megatron_rl.train.sft import read_jsonl, to_sequences, tokenize_record
    from megatron_rl.train.trainer import Trainer

    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--data", required=True)
    args = p.parse_args(argv)
    try:
        cfg = load_config_args(args.config, args.overrides)
        records = read_jsonl(args.data)
    except (ConfigError, ValueError, OSError) as e:
        print(f"logprobs_eval: {e}", file=sys.stderr)
        return 1
    trainer = Trainer(cfg, keep_checkpoints=0)
    tok = resolve_model(cfg.trainer.model).tokenizer() if any("prompt_ids" not in r for r in records) else None
    seqs, dropped = to_sequences((tokenize_record(r, tok) for r in records), cfg.trainer.micro_batch_tokens)
    metrics = trainer.evaluate(seqs, objective="sft")
    metrics = {k: float(v) for k, v in metrics.items()} | {"sequences": len(seqs), "dropped": dropped}
    if not dist.is_initialized() or dist.get_rank() == 0:
        out = Path(cfg.run.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "logprobs_eval.json").write_text(json.dumps(metrics, indent=2))
        print(json.dumps(metrics), flush=True)
    return 0
